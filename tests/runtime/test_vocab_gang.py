"""The gangs of the ``gpt-sharded-vocab`` stage graph run for real: the ``gpt-vocab`` model
(vocabulary-sharded embedding and head, one shard per rank) over gloo at p = 2 (the schedule
``flexpipe search --preset gpt-sharded-vocab -p 2 -m 4`` wrote, and list-scheduled fused and
B/W-split schedules of the ``sharded`` layout) and p = 3 (``sharded-interleaved``): same
losses, first-step gradients and parameters after 3 SGD steps as one process (which computes
one cross-entropy over the whole vocabulary), to 1e-9 in float64. Every rank's loss is CE/p of
the whole vocabulary, which only the head's all-reduces can give. One launch per rank count (the
one every runtime test file of that many ranks shares, ``shared_launch``)."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import shared_launch
import torch

from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError
from flexpipe.graphs import preset
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.text import parse_schedule
from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.kinds import check_model_graph, check_parallel, model_segments
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import check_job
from flexpipe.runtime.processes.reference import Reference, reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig

pytestmark = pytest.mark.timeout(shared_launch.TIMEOUT_S)
RTOL = 1e-9
M = 4
HERE = Path(__file__).parent
TRAIN = TrainConfig(steps=3, capture=True, timeout_s=60)
POLICIES = {"fused": Policy(prefer=("B", "F"), split=False),
            "split": Policy(prefer=("B", "F", "W"), split=True)}


def spec(p: int) -> ModelSpec:
    """A small float64 ``gpt-vocab`` with p shards."""
    return ModelSpec("gpt-vocab", layers=4, hidden=16, heads=2, vocab=24, seq=6, micro_batch=4,
                     dtype="float64", shards=p)


def gang_schedule(p: int, layout: str, policy: str) -> Schedule:
    """The list scheduler's schedule of the preset's graph (gangs included) and placement."""
    gm = preset("gpt-sharded-vocab", p, layout)
    return policy_schedule(gm.placement, M, POLICIES[policy], graph=gm.graph,
                           name=f"{layout}-{policy}")


@cache
def _jobs(p: int) -> dict[str, Job]:
    if p == 2:
        searched = parse_schedule((HERE / "vocab_gang_p2.txt").read_text())
        jobs = {"searched": Job(searched, spec(2), TRAIN)}
        jobs |= {f"sharded-{pol}": Job(gang_schedule(2, "sharded", pol), spec(2), TRAIN)
                 for pol in POLICIES}
        return jobs
    return {"interleaved-split": Job(gang_schedule(3, "sharded-interleaved", "split"), spec(3),
                                     TRAIN)}


for _p in (2, 3):
    shared_launch.register(_p, "vocab-gang", lambda p=_p: shared_launch.jobs(_jobs(p).values(), p))


@pytest.fixture(scope="module", params=[2, 3], ids=["p2", "p3"])
def runs(request: pytest.FixtureRequest) -> tuple[int, dict[str, list[RankResult]]]:
    """The jobs of each rank count, in the shared launch of that many processes; results by
    job name."""
    results = shared_launch.job_results(request.param, "vocab-gang")
    return request.param, dict(zip(_jobs(request.param), results, strict=True))


_REFERENCES: dict[int, Reference] = {}


def reference(p: int) -> Reference:
    """The single-process run with p shards (cached)."""
    if p not in _REFERENCES:
        _REFERENCES[p] = reference_run(spec(p), TRAIN, M)
    return _REFERENCES[p]


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    name, err = worst_relative_error(got, want)
    assert err <= RTOL, f"{what} {name}: relative diff {err:.3g}"


def test_gangs_match_one_process(runs: tuple[int, dict[str, list[RankResult]]]) -> None:
    p, by_job = runs
    ref = reference(p)
    assert ref.losses[-1] < ref.losses[0], "the reference does not learn"
    for name, ranks in by_job.items():
        assert all(r.losses[0] is not None for r in ranks), f"{name}: every rank holds a head"
        for r in ranks:  # CE/p of the whole vocabulary on every rank: the F all-reduces ran
            got = [p * loss for loss in r.losses if loss is not None]
            assert got == pytest.approx(ref.losses, rel=RTOL), f"{name} rank {r.rank}"
        _close(by_name(ranks, "grads"), ref.grads, f"{name}: gradient")
        _close(by_name(ranks, "params"), ref.params, f"{name}: parameter after 3 steps")


def test_model_graph_is_the_preset() -> None:
    for p in (2, 3):
        for layout in ("sharded", "sharded-interleaved", "sharded-vshape"):
            gm = preset("gpt-sharded-vocab", p, layout)
            check_model_graph(spec(p), None, gm.graph)
    segments, _ = model_segments(spec(3))
    assert [s.name for s in segments] == ["embed0", "embed1", "embed2", "body",
                                          "head0", "head1", "head2"]


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ConfigError, match="vocab 25 is not divisible by shards 2"):
        model_segments(replace(spec(2), vocab=25))
    job = Job(gang_schedule(2, "sharded", "fused"), spec(2), replace(TRAIN, dp=2))
    with pytest.raises(ConfigError, match=r"plain pipeline only \(dp 2, tp 1"):
        check_job(job, 4)
    with pytest.raises(ConfigError, match="3 shards but the schedule has 2 pipeline ranks"):
        check_parallel(spec(3), 2, 1, 1)
