"""Nothing lost (issue #28): non-finite losses and gradients are found on the step they appear
and named, never stepped into a checkpoint; ranks given different jobs are named; the
checkpoint directory is checked, locked and cleaned before training; a full disk is named. The
launches that succeed run in the shared 2-process launch (``shared_launch``); those that must
fail have their own."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import shared_launch
import torch
from torch import nn

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes import ckdir, jobcheck, numerics, saved
from flexpipe.runtime.processes.launch import LaunchError, launch_task


class Stage(nn.Module):
    """A stand-in stage: one linear layer, its parameters under global names."""

    def __init__(self, index: int) -> None:
        super().__init__()
        torch.manual_seed(index)
        self.lin = nn.Linear(3, 2)
        self.index = index

    def named_global_parameters(self) -> dict[str, nn.Parameter]:
        return {f"s{self.index}.{n}": p for n, p in self.named_parameters()}


def _as_stages(stage: Stage) -> Any:
    """``{0: stage}`` for the checkpoint writer (which reads only global parameter names)."""
    return {0: stage}


def _stage_with_grads(index: int, poison: str | None = None) -> Stage:
    stage = Stage(index)
    stage.lin(torch.ones(4, 3)).sum().backward()
    if poison == "grad":
        assert stage.lin.bias.grad is not None
        stage.lin.bias.grad[1] = float("inf")
    return stage


def test_first_nonfinite_names_the_tensor() -> None:
    good = {"a": torch.ones(3), "b": torch.zeros(2, 2), "ids": torch.tensor([1, 2])}
    assert numerics.first_nonfinite(good) is None
    assert numerics.first_nonfinite({**good, "c": torch.tensor([1.0, float("nan")])}) == "c"
    assert numerics.first_nonfinite({"x": None, "y": torch.tensor([-float("inf")])}) == "y"


def test_local_problem_names_step_rank_stage_and_what() -> None:
    stages = {0: _stage_with_grads(0), 1: _stage_with_grads(1)}
    assert numerics.local_problem(0, 0, stages, 2.5, 1) is None
    assert numerics.local_problem(1, 3, stages, float("nan"), 1) == \
        "step 2, rank 3, stage 1: the loss is nan"
    stages[1] = _stage_with_grads(1, poison="grad")
    assert numerics.local_problem(4, 1, stages, 1.0) == \
        "step 5, rank 1, stage 1: the gradient of parameter s1.lin.bias holds inf"


def nan_task(rank: int, world: int, bad_rank: int, policy: str) -> list[object]:
    """Every rank checks its stage after a backward; ``bad_rank``'s gradient holds inf."""
    stage = _stage_with_grads(rank, "grad" if rank == bad_rank else None)
    applied = numerics.guard_step(2, rank, {rank: stage}, 1.0, policy)
    grads = [float(p.grad.abs().sum()) for p in stage.parameters() if p.grad is not None]
    return [applied, grads]


def test_a_nonfinite_gradient_stops_every_rank_naming_where_it_appeared() -> None:
    with pytest.raises(LaunchError) as info:
        launch_task(nan_task, (1, "stop"), 3, timeout_s=30, deadline_s=120)
    err = info.value
    first = str(err).splitlines()[0]
    assert err.culprit == 1, str(err)
    assert "step 3, rank 1, stage 1: the gradient of parameter s1.lin.bias holds inf" in first
    assert all(code not in (None, 0) for code in err.exit_codes.values())


def _agreeing_ranks() -> dict[str, Any]:
    """The part of the shared 2-process launch: ``nan_task`` under ``skip`` with rank 0's
    gradient poisoned and with none, and ``job_task`` given the same job on both ranks."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return {"skip": nan_task(rank, world, 0, "skip"), "clean": nan_task(rank, world, -1, "skip"),
            "agreed": job_task(rank, world, [3, 3])}


@pytest.fixture(scope="module")
def agreeing() -> dict[str, list[Any]]:
    """Each case of ``_agreeing_ranks``: every rank's result."""
    per_rank = shared_launch.results(2, "nothing-lost")
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_skip_drops_the_update_on_every_rank(agreeing: dict[str, list[Any]]) -> None:
    ranks = agreeing["skip"]
    assert [r[0] for r in ranks] == [False, False]
    assert all(g == 0.0 for r in ranks for g in r[1])  # gradients zeroed: no update
    clean = agreeing["clean"]
    assert [r[0] for r in clean] == [True, True] and all(g > 0 for g in clean[0][1])


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown non-finite policy 'maybe'.*stop, skip"):
        numerics.check_policy("maybe")


def _optimizer(stage: Stage) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(stage.parameters(), lr=0.1)
    stage.lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    return opt


def test_a_checkpoint_with_nonfinite_values_is_never_written(tmp_path: Path) -> None:
    stage = Stage(0)
    opt = _optimizer(stage)
    ck.save(tmp_path, 1, _as_stages(stage), opt)
    with torch.no_grad():
        stage.lin.weight[0, 0] = float("nan")
    with pytest.raises(numerics.NonFiniteError, match="parameter s0.lin.weight holds nan"):
        ck.save(tmp_path, 2, _as_stages(stage), opt)
    assert not (tmp_path / "step-00000002").exists()
    assert not saved.staging(tmp_path / "step-00000002").exists()
    assert ck.latest(tmp_path) is not None and ck.latest(tmp_path).step == 1  # type: ignore[union-attr]


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    stage = Stage(0)
    opt = _optimizer(stage)
    for step in range(1, 5):
        ck.save(tmp_path, step, _as_stages(stage), opt)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003",
                                                                "step-00000004"]


def test_a_full_disk_is_named_with_the_path(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    stage = Stage(0)
    opt = _optimizer(stage)
    ck.save(tmp_path, 1, _as_stages(stage), opt)
    real_open = Path.open

    def full(self: Path, mode: str = "r", *args: object, **kwargs: object) -> object:
        if "w" in mode and self.name.endswith(".distcp"):
            with open(self, "wb") as f:  # the file exists, then the disk is full
                f.write(b"partial")
            return real_open(Path("/dev/full"), mode)
        return real_open(self, mode, *args, **kwargs)  # type: ignore[call-overload]

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(RunError, match=r"could not write the checkpoint .*step-00000002"
                       r"\.saving: .*No space left on device"):
        ck.save(tmp_path, 2, _as_stages(stage), opt)
    monkeypatch.undo()
    assert not (tmp_path / "step-00000002").exists()  # never renamed into place
    assert ck.latest(tmp_path).step == 1  # type: ignore[union-attr]
    ck.save(tmp_path, 2, _as_stages(stage), opt)  # the next save clears the unfinished one
    assert not saved.staging(tmp_path / "step-00000002").exists()
    err = ckdir.write_error(tmp_path / "x", OSError(errno.ENOSPC, "No space left on device"))
    assert "(ENOSPC)" in str(err) and str(tmp_path / "x") in str(err)


def test_checkpoint_dir_checked_before_training(tmp_path: Path) -> None:
    said: list[str] = []
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="is not usable: cannot write in it"):
        ckdir.prepare(blocker / "ck", ckdir.Plan(10), said.append)
    with pytest.raises(ConfigError, match="free, one checkpoint needs about"):
        ckdir.prepare(tmp_path / "ck", ckdir.Plan(1 << 62), said.append)
    with ckdir.prepare(tmp_path / "ck", ckdir.Plan(10), said.append):  # the lock was let go
        pass


def test_a_held_directory_is_refused_and_a_stale_lock_taken_over(tmp_path: Path) -> None:
    said: list[str] = []
    first = ckdir.prepare(tmp_path, ckdir.Plan(10), said.append)
    with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} on"):
        ckdir.prepare(tmp_path, ckdir.Plan(10), said.append)
    first.release()
    (tmp_path / ckdir.LOCK).write_text("pid=999999 host=elsewhere since=0\n")
    folder = tmp_path / "step-00000002"
    folder.mkdir()
    (folder / ".stage-0.pt.tmp4242").write_bytes(b"half")
    with ckdir.prepare(tmp_path, ckdir.Plan(10), said.append):
        assert "pid=" in (tmp_path / ckdir.LOCK).read_text()
    assert said[0].startswith("took over the stale lock of pid 999999 on elsewhere")
    assert "removed 1 temporary file" in said[1] and not list(folder.iterdir())


def _job(seed: int = 0, lr: float = 0.1, m: int = 4, folder: str | None = None) -> object:
    from flexpipe.schedules import registry

    return SimpleNamespace(schedule=registry.build("1f1b", 2, m), partition=None,
                           model=SimpleNamespace(name="gpt", seed=seed, hidden=8, dtype="float32"),
                           train=SimpleNamespace(steps=3, lr=lr, optimizer="sgd", dp=1,
                                                 checkpoint_dir=folder))


def test_job_differences_name_the_field_and_the_ranks() -> None:
    same = jobcheck.describe_job(_job())
    assert jobcheck.differences([same, same, same]) == []
    every = [same, jobcheck.describe_job(_job(seed=1)), same]
    assert jobcheck.differences(every) == ["--seed: 0 on ranks 0, 2; 1 on rank 1"]
    lines = jobcheck.differences([same, jobcheck.describe_job(_job(m=6, lr=0.2))])
    assert [line.split(":")[0] for line in lines] == ["schedule ops", "-m", "--lr"]
    folders = jobcheck.differences([jobcheck.describe_job(_job(folder="a/ck")),
                                    jobcheck.describe_job(_job(folder="b"))])
    assert folders == [f"--checkpoint-dir: {os.path.abspath('a/ck')} on rank 0; "
                       f"{os.path.abspath('b')} on rank 1"]
    shapes = [jobcheck.shape_digest([("w", (2, 3))]), jobcheck.shape_digest([("w", (3, 3))])]
    assert shapes[0].startswith("6 parameters") and shapes[0] != shapes[1]


def job_task(rank: int, world: int, seeds: list[int]) -> list[object]:
    jobcheck.agree_job(_job(seed=seeds[rank]))
    return ["agreed"]


shared_launch.register(2, "nothing-lost", lambda: (_agreeing_ranks, ()))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_ranks_with_different_jobs_fail_together_naming_the_field(
        agreeing: dict[str, list[Any]]) -> None:
    assert agreeing["agreed"] == [["agreed"], ["agreed"]]
    with pytest.raises(LaunchError) as info:
        launch_task(job_task, ([3, 4],), 2, timeout_s=30, deadline_s=60)
    text = str(info.value)
    assert "the ranks were given different jobs" in text and \
        "--seed: 3 on rank 0; 4 on rank 1" in text, text
    assert "Traceback" not in text


TINY = ["--hidden", "16", "--seq", "8", "--vocab", "32", "--layers", "2", "--timeout", "30"]


def test_cli_nan_stops_the_run_and_keeps_the_last_good_checkpoint(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from flexpipe.cli.main import main

    folder = tmp_path / "ck"
    code = main(["run", "1f1b", "-p", "2", "-m", "4", "--steps", "6", "--lr", "1e30",
                 "--checkpoint-dir", str(folder), "--checkpoint-every", "1", *TINY])
    err = capfd.readouterr().err
    assert code != 0 and "non-finite numbers at step 2, rank" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000001"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder / "step-00000001", tmp_path / "whole.pt")
    data = torch.load(tmp_path / "whole.pt", weights_only=True)
    tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    assert any(k.startswith("model.") for k in tensors) and \
        numerics.first_nonfinite(tensors) is None


def test_cli_nan_skip_goes_on_without_stepping(tmp_path: Path,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    from flexpipe.cli.main import main

    code = main(["run", "1f1b", "-p", "2", "-m", "2", "--steps", "3", "--lr", "1e30",
                 "--on-nan", "skip", "--checkpoint-dir", str(tmp_path), *TINY])
    err = capfd.readouterr().err
    assert code == 0 and "update is skipped (--on-nan skip)" in err, err
    assert ck.latest(tmp_path) is not None  # the weights stayed finite: written


@pytest.mark.parametrize(("factory", "words"), [
    ("nan_models:inf_data", "the gradient of parameter"),
    ("nan_models:nan_loss", "the loss is nan"),
])
def test_cli_user_model_nan_is_named(capfd: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch, factory: str,
                                     words: str) -> None:
    from flexpipe.cli.main import main

    monkeypatch.chdir(Path(__file__).parent)
    code = main(["run", "1f1b", "-p", "2", "-m", "2", "--steps", "2", "--model", factory,
                 "--timeout", "30"])
    err = capfd.readouterr().err
    assert code != 0 and "non-finite numbers at step 1" in err and words in err, err


def test_cli_factory_building_another_model_per_rank_is_named(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from flexpipe.cli.main import main

    monkeypatch.chdir(Path(__file__).parent)
    code = main(["run", "1f1b", "-p", "2", "-m", "2", "--steps", "1", "--model",
                 "nan_models:per_rank_width", "--timeout", "30"])
    err = capfd.readouterr().err
    assert code != 0 and "the ranks were given different jobs" in err, err
    assert "model shapes:" in err and "on rank 0" in err and "on rank 1" in err, err


def test_cli_a_busy_checkpoint_dir_is_refused_before_training(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from flexpipe.cli.main import main

    with ckdir.prepare(tmp_path, ckdir.Plan(0), print):
        code = main(["run", "1f1b", "-p", "2", "-m", "2", "--steps", "1",
                     "--checkpoint-dir", str(tmp_path), *TINY])
    err = capfd.readouterr().err
    assert code == 2 and "is in use by another run" in err and "step 1/" not in err, err


@pytest.mark.parametrize("flags", [["--hidden", "4000000"], ["--layers", "1000000000"]])
def test_cli_a_model_too_big_is_refused_before_allocating(
        capfd: pytest.CaptureFixture[str], flags: list[str]) -> None:
    from flexpipe.cli.main import main

    code = main(["run", "1f1b", "-p", "2", "-m", "2", *flags])
    err = capfd.readouterr().err
    assert code == 2 and "needs about" in err and "--no-size-guard" in err, err
