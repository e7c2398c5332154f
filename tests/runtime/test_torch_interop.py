"""Interop with torch.distributed.pipelining, both ways.

Export: FlexPipe schedules (1F1B, ZB-H1, the DSL-written example, and torch's own ZB-V read
back from torch) exported as torch's compute-only CSV and run by torch's runtime on 2 gloo
processes give the same loss and gradients as FlexPipe's executor and as one device.
Import: torch's built-in schedule classes read into FlexPipe schedules validate, simulate, and
equal FlexPipe's own where the algorithms coincide.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.interop.torch_interop import TorchRank, export_for_torch, run_both
from flexpipe.runtime.interop.torch_schedules import names, torch_schedule
from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig
from flexpipe.sim.engine import simulate
from flexpipe.sim.validate import check
from flexpipe.specs import load

RTOL = 1e-5
P, M = 2, 6  # m = 6: torch's 1/m gradient scaling is not exact, FlexPipe's loss/m neither
GPT = ModelSpec("gpt", layers=4, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2,
                dtype="float64")
EXAMPLE = str(Path(__file__).parents[2] / "examples" / "my_1f1b_early_w.py")
RUNS = {"1f1b": "1f1b", "zb-h1": "zb-h1", "dsl": EXAMPLE, "torch-zbv": "torch:zbv"}


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Schedule, list[RankResult], list[TorchRank]]]:
    """One launch: every schedule by FlexPipe's executor, then by torch's runtime."""
    schedules = {key: load(spec, P, M) for key, spec in RUNS.items()}
    jobs = [Job(s, GPT, TrainConfig(timeout_s=60)) for s in schedules.values()]
    results = run_both(jobs, timeout_s=60)
    return {key: (s, *res) for (key, s), res in zip(schedules.items(), results, strict=True)}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    zero = [name for name, ref in want.items() if ref.norm().item() == 0]
    assert not zero, f"{what} {zero[:3]}: zero reference gradient"
    name, err = worst_relative_error(got, want)
    assert err <= RTOL, f"{what} {name}: relative diff {err:.3g}"


def _merged(ranks: list[RankResult] | list[TorchRank]) -> dict[str, torch.Tensor]:
    return by_name(ranks, "grads")


@pytest.mark.parametrize("key", list(RUNS))
def test_torch_runtime_runs_exported_schedule(runs, key: str) -> None:  # noqa: ANN001
    schedule, ours, theirs = runs[key]
    ours_loss = [r.losses[0] for r in ours if r.losses[0] is not None]
    torch_loss = [r.loss for r in theirs if r.loss is not None]
    assert len(ours_loss) == len(torch_loss) == 1
    assert torch_loss[0] == pytest.approx(ours_loss[0], rel=RTOL)
    _close(_merged(theirs), _merged(ours), f"{key}: torch vs FlexPipe gradient")
    ref = reference_run(GPT, TrainConfig(steps=1), M)
    assert torch_loss[0] == pytest.approx(ref.losses[0], rel=RTOL)
    _close(_merged(theirs), ref.grads, f"{key}: torch vs one device gradient")


def test_export_rejects_what_torch_cannot_run() -> None:
    with pytest.raises(ConfigError, match="cannot express"):
        export_for_torch(load("1f1b-recompute", P, M))
    one = load("gpipe", P, M)
    last = list(one.ranks[1])
    f0, f1 = last.index(("F", 1, 0)), last.index(("F", 1, 1))
    last[f0], last[f1] = last[f1], last[f0]  # F1 before F0 on the last stage: still valid
    swapped = one.with_ranks([one.ranks[0], last])
    check(swapped)
    with pytest.raises(ConfigError, match="micro-batch order"):
        export_for_torch(swapped)
    with pytest.raises(ConfigError, match="replicas"):
        run_both([Job(one, GPT, TrainConfig(dp=2))])


# torch name, its v, FlexPipe name, FlexPipe's v, "order" (same ops) or "makespan" (same time)
MATCHES = [
    ("gpipe", None, "gpipe", None, "order"),
    ("interleaved-1f1b", 2, "interleaved-1f1b", 2, "order"),
    ("interleaved-zb", 1, "zb-h1", None, "order"),
    ("interleaved-1f1b", 1, "1f1b", None, "makespan"),
    ("bfs", 2, "bfs", 2, "makespan"),
    ("zbv", None, "zb-v", None, "makespan"),
    ("dualpipev", None, "dualpipev", None, "order"),
]


@pytest.mark.parametrize(("theirs", "tv", "ours", "ov", "how"), MATCHES)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_imported_torch_schedule_matches_ours(theirs: str, tv: int | None, ours: str,
                                              ov: int | None, how: str, p: int, m: int) -> None:
    got = load(f"torch:{theirs}", p, m, v=tv)
    want = load(ours, p, m, v=ov)
    assert got.placement == want.placement
    if how == "order":
        assert got.ranks == want.ranks and got.overlaps == want.overlaps  # OVERLAP_F_B kept
    else:
        assert got.ranks != want.ranks
        assert simulate(got).metrics().makespan == simulate(want).metrics().makespan


@pytest.mark.parametrize("name", [n for n in names() if n != "1f1b"])
def test_every_torch_schedule_validates_and_simulates(name: str) -> None:
    schedule = torch_schedule(name, 4, 8)
    check(schedule)
    metrics = simulate(schedule).metrics()
    one_f_one_b = simulate(load("1f1b", 4, 8)).metrics()
    assert metrics.bubble_rate <= one_f_one_b.bubble_rate + 1e-9
    assert sum(op.kind == "F" for _, _, op in schedule.ops()) == 8 * schedule.num_stages


def test_torch_1f1b_order_is_reported_invalid() -> None:
    # torch 2.13's Schedule1F1B.pipeline_order skips micro-batch 0 on the last rank
    with pytest.raises(ConfigError, match=r"Schedule1F1B\.pipeline_order is not a valid"):
        load("torch:1f1b", 4, 8)


def test_torch_specs_errors() -> None:
    with pytest.raises(ConfigError, match="known: torch:1f1b"):
        load("torch:nope", 2, 4)
    with pytest.raises(ConfigError, match="needs -p and -m"):
        load("torch:zbv", 2)
    with pytest.raises(ConfigError, match="exactly 2 stage"):
        load("torch:zbv", 2, 4, v=3)
    with pytest.raises(ConfigError, match="no parameter w"):
        load("torch:gpipe", 2, 4, w=1)


@pytest.mark.parametrize("command", ["show", "simulate"])
def test_cli_accepts_torch_specs(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "torch:zbv", "-p", "4", "-m", "8"]) == 0
    assert "torch:zbv" in capsys.readouterr().out
