"""The two-tower (CLIP-like) model, a stage graph with a join, run for real over gloo at 3 ranks
(image tower, text tower, join) and 4 ranks (image tower over two ranks; or the text tower over
two, so a boundary carrying hidden states and integer ids crosses ranks): same loss, same
gradient of every parameter, same parameters after three optimizer steps as one process. Each
placement runs a fused (1F1B-like) and a B/W-split (ZB-like) policy schedule, and the 3-rank
launch also a hand-written schedule file with ``edges:``, and profiles the 3-rank layout. One
launch per rank count (the one every runtime test file of that many ranks shares,
``shared_launch``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import shared_launch
import torch

from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.text import parse_schedule
from flexpipe.runtime.execution.segments import build_graph_stages, plan_stages
from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.kinds import model_segments
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import Reference, reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig

pytestmark = pytest.mark.timeout(shared_launch.TIMEOUT_S)
RTOL = 1e-5
M = 4
CLIP = ModelSpec("clip", layers=1, hidden=16, heads=2, vocab=32, seq=6, micro_batch=4,
                 dtype="float64")
TRAIN = TrainConfig(steps=3, capture=True, timeout_s=60)
HERE = Path(__file__).parent
# name -> (graph edges, stage ranks, micro-batches begun ahead per rank, partition)
LAYOUTS: dict[str, tuple[tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...],
                         tuple[int, ...] | None]] = {
    "p3": (((0, 2), (1, 2)), (0, 1, 2), (2, 2, 1), None),
    "p4-image": (((0, 1), (1, 3), (2, 3)), (0, 1, 2, 3), (3, 2, 2, 1), None),
    "p4-text": (((1, 2), (0, 3), (2, 3)), (0, 1, 2, 3), (2, 3, 2, 1), (3, 2, 1, 1)),
}
POLICIES = {"fused": Policy(prefer=("B", "F"), split=False),
            "split": Policy(prefer=("B", "F", "W"), split=True)}


def graph_schedule(layout: str, policy: str) -> Schedule:
    """A list-scheduled schedule of a placement (1F1B-like warm-up depth per rank)."""
    edges, ranks, ahead, _ = LAYOUTS[layout]
    pol = Policy(prefer=POLICIES[policy].prefer, split=POLICIES[policy].split, max_ahead=ahead)
    return policy_schedule(Placement(ranks, max(ranks) + 1), M, pol,
                           graph=StageGraph(len(ranks), edges), name=f"{layout}-{policy}")


@cache
def _jobs(p: int) -> dict[str, Job]:
    layouts = [k for k in LAYOUTS if k.startswith(f"p{p}")]
    jobs = {f"{k}-{pol}": Job(graph_schedule(k, pol), CLIP, TRAIN, LAYOUTS[k][3])
            for k in layouts for pol in POLICIES}
    if p == 3:
        text = (HERE / "two_tower_p3.txt").read_text()
        jobs["p3-file"] = Job(parse_schedule(text), CLIP, TRAIN)
    return jobs


for _p in (3, 4):
    shared_launch.register(_p, "two-tower",
                           lambda p=_p: shared_launch.jobs(_jobs(p).values(), p))


@pytest.fixture(scope="module", params=[3, 4], ids=["p3", "p4"])
def runs(request: pytest.FixtureRequest) -> dict[str, list[RankResult]]:
    """The jobs of each rank count, in the shared launch of that many processes; results by
    job name."""
    results = shared_launch.job_results(request.param, "two-tower")
    return dict(zip(_jobs(request.param), results, strict=True))


@pytest.fixture(scope="module")
def reference() -> Reference:
    """The single-process run."""
    return reference_run(CLIP, TRAIN, M)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    name, err = worst_relative_error(got, want)
    assert err <= RTOL, f"{what} {name}: relative diff {err:.3g}"


def test_every_run_matches_one_process(runs: dict[str, list[RankResult]],
                                       reference: Reference) -> None:
    assert reference.losses[-1] < reference.losses[0], "the reference does not learn"
    for name, ranks in runs.items():
        losses = [r.losses for r in ranks if r.losses[0] is not None]
        assert len(losses) == 1, f"{name}: exactly the join rank reports the loss"
        assert losses[0] == pytest.approx(reference.losses, rel=RTOL), name
        _close(by_name(ranks, "grads"), reference.grads, f"{name}: gradient")
        _close(by_name(ranks, "params"), reference.params, f"{name}: parameter after 3 steps")


def test_layouts_are_the_model_graph() -> None:
    segments, _ = model_segments(CLIP)
    for edges, ranks, _, partition in LAYOUTS.values():
        assert plan_stages(segments, partition, len(ranks)).graph.edges == edges


def test_schedule_graph_must_match_the_model() -> None:
    segments, _ = model_segments(CLIP)
    swapped = StageGraph(3, ((1, 2), (0, 2)))  # the join would take text before image
    with pytest.raises(ConfigError, match=r"stage 2 takes its inputs from stages \[0, 1\]"):
        build_graph_stages(segments, None, 3, graph=swapped)
    with pytest.raises(ConfigError, match="does not cut at the segment boundaries"):
        build_graph_stages(segments, (2, 2, 2, 1), 4)
    with pytest.raises(ConfigError, match="3 segments, more than the 2 stages"):
        build_graph_stages(segments, None, 2)


PROFILED = Placement((0, 1, 2), 3)
shared_launch.register(3, "two-tower-profile", lambda: shared_launch.profiles([(CLIP, PROFILED)]))


def test_profile_a_graph_model() -> None:
    """The profile of the two towers, in the shared 3-process launch."""
    cost, = shared_launch.cost_models(3, "two-tower-profile", [PROFILED])
    towers, join = cost.stages[:2], cost.stages[2]
    assert all(c.out_bytes == 16 * CLIP.micro_batch * 8 for c in towers)  # pooled float64
    assert join.out_bytes == 0 and join.input == 2 * 16 * CLIP.micro_batch * 8
    assert all(c.time(k) > 0 for c in cost.stages for k in ("F", "BW"))
