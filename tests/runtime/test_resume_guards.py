"""Nothing lost around a resume: a run that resumes is not refused for space it does not need
(told instead, and each checkpoint checked for room just before it is written, on every rank
together); a checkpoint whose optimizer state (or parameters) hold NaN or inf is refused naming
the tensor; something in the way of a step folder is refused before training (what an
interrupted checkpoint left is replaced); ranks whose factory builds other weights (same
shapes) are refused at start-up."""

from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes import ckdir
from flexpipe.runtime.processes.launch import LaunchError, launch_task
from flexpipe.runtime.processes.train import Job, TrainConfig, run_job
from flexpipe.schedules import registry

TINY = ["--hidden", "16", "--seq", "8", "--vocab", "32", "--layers", "2", "--timeout", "30"]
Usage = namedtuple("Usage", "total used free")


def test_due_steps_follow_the_writer() -> None:
    assert ckdir.plan_for(5, 0, 6, 2).due == (2, 4, 6)
    assert ckdir.plan_for(5, 4, 6, 0).due == (6,)
    assert ckdir.plan_for(5, 6, 6, 1).due == ()  # every step done: nothing to write
    assert ckdir.plan_for(5, 3, 7, 3).due == (6, 7)


def _full(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(ckdir.shutil, "disk_usage", lambda _: Usage(free * 10, free * 9, free))


def test_space_is_checked_only_when_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _full(monkeypatch, 1000)
    said: list[str] = []
    with pytest.raises(ConfigError, match="has 1000 B free, one checkpoint needs about"):
        ckdir.prepare(tmp_path, ckdir.plan_for(4096, 0, 3, 0), said.append)
    with ckdir.prepare(tmp_path, ckdir.plan_for(4096, 3, 3, 0), said.append):
        assert said == []  # resumes with every step done: writes nothing, needs no room
    with ckdir.prepare(tmp_path, ckdir.plan_for(4096, 2, 5, 1), said.append):
        pass
    assert len(said) == 1 and "resuming from" in said[0] and "step-00000002" in said[0], said
    assert "after step 3 is checked again" in said[0], said


def test_the_room_is_checked_before_a_checkpoint_is_written() -> None:
    assert ckdir.room(Path("ck"), 10, 10, 4) is None
    problem = ckdir.room(Path("ck"), 2 << 20, 1 << 20, 4)
    assert problem is not None and "checkpoint of step 4 not written" in problem
    assert "1.00 MiB free, it needs about 2.00 MiB" in problem


def test_free_space_of_a_folder_not_made_yet(tmp_path: Path) -> None:
    assert ckdir.free_space(tmp_path / "a" / "b") == shutil.disk_usage(tmp_path).free


@pytest.mark.parametrize("blocker", ["step-00000002", "step-00000004/__1_0.distcp",
                                     "step-00000004/flexpipe-manifest.json",
                                     "step-00000004/notes.txt"])
def test_something_in_the_way_is_refused_naming_it(tmp_path: Path, blocker: str) -> None:
    path = tmp_path / blocker
    if blocker.endswith(".txt"):  # a file FlexPipe does not write
        path.parent.mkdir(parents=True)
        path.write_text("mine")
    elif "/" in blocker:
        path.mkdir(parents=True)  # a folder where a file goes
    else:
        path.write_text("not a folder")
    plan = ckdir.plan_for(10, 0, 4, 2)
    with pytest.raises(ConfigError, match=str(path)):
        ckdir.prepare(tmp_path, plan, print)
    ckdir.in_the_way(tmp_path, ckdir.plan_for(10, 0, 3, 3))  # writes step 3 only: fine
    if "/" not in blocker:  # a link to nowhere is in the way as well
        path.unlink()
        path.symlink_to(tmp_path / "nowhere")
        with pytest.raises(ConfigError, match="is not a folder"):
            ckdir.in_the_way(tmp_path, plan)


def test_a_resume_refuses_what_is_in_the_way_after_choosing_its_start(tmp_path: Path) -> None:
    (tmp_path / "step-00000003").write_text("x")
    resumer = ck.Checkpointer(tmp_path, 3, 6, 0, {}, 30.0, {})
    with pytest.raises(ConfigError, match="step-00000003' is not a folder"):
        resumer.resume({}, torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


def _stages(optimizer: str) -> tuple[dict[int, nn.Module], torch.optim.Optimizer]:
    from flexpipe.runtime.execution.segments import build_stages
    from flexpipe.runtime.models.kinds import build_model
    from flexpipe.runtime.processes.train import make_optimizer

    built, _ = build_model(ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4))
    stages = build_stages(built, None, 2)
    params = [q for s in stages.values() for q in s.parameters()]
    opt = make_optimizer(params, TrainConfig(optimizer=optimizer))
    for q in params:
        q.grad = torch.ones_like(q)
    opt.step()
    return stages, opt  # type: ignore[return-value]


def test_what_an_interrupted_checkpoint_left_is_replaced(tmp_path: Path) -> None:
    """A step folder holding only FlexPipe's files (an older per-stage checkpoint cut short,
    DCP files without their manifest) is not in the way: it is replaced by the new one."""
    stages, opt = _stages("sgd")
    folder = ck.step_dir(tmp_path, 2)
    folder.mkdir()
    (folder / "stage-0.pt").write_bytes(b"cut short")
    (folder / "__0_0.distcp").write_bytes(b"cut short")
    ckdir.in_the_way(tmp_path, ckdir.plan_for(10, 0, 2, 1))
    ck.save(tmp_path, 2, stages, opt)
    assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp",
                                                         "flexpipe-manifest.json"]
    assert ck.latest(tmp_path) is not None


@pytest.mark.parametrize(("optimizer", "key", "value"), [
    ("adamw", "exp_avg_sq", float("inf")), ("adamw", "exp_avg", float("nan")),
    ("sgd", "momentum_buffer", float("-inf")), ("sgd", None, float("nan"))])
def test_a_nonfinite_checkpoint_not_written_here_is_refused_naming_the_tensor(
        tmp_path: Path, optimizer: str, key: str | None, value: float) -> None:
    """A DCP checkpoint holding a NaN or an infinity (written past the writer's check, as by
    hand): refused after loading, naming the tensor."""
    from flexpipe.runtime.processes import dcp

    stages, opt = _stages(optimizer)
    mine = ck.named(stages)  # type: ignore[arg-type]
    name = sorted(mine)[-1]
    with torch.no_grad():
        target = opt.state[mine[name]][key] if key else mine[name]
        saved_value = target.view(-1)[-1].clone()
        target.view(-1)[-1] = value
    folder = ck.step_dir(tmp_path, 2)
    dcp.save(mine, str(folder), opt, {id(p): n for n, p in mine.items()},
             extra={"step": 2, "samples": 0, "meta": {}, "layout": {}, "rng": []})
    with torch.no_grad():
        target.view(-1)[-1] = saved_value
    manifest = ck.latest(tmp_path)
    assert manifest is not None
    what = f"optimizer state {key} of {name}" if key else f"parameter {name}"
    with pytest.raises(ConfigError, match=f"{what} holds non-finite values"):
        ck.load(manifest, stages, opt, {})  # type: ignore[arg-type]


def full_disk_task(rank: int, world: int, folder: str) -> list[object]:
    """Two steps with a checkpoint after each; this file system has 64 KiB free from the
    second checkpoint on (patched in the rank itself)."""
    real = ckdir.free_space
    calls = []

    def free(root: Path) -> int:
        calls.append(root)
        return real(root) if len(calls) == 1 else 64 * 1024

    ckdir.free_space = free  # type: ignore[assignment]
    model = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)
    job = Job(registry.build("1f1b", world, 2), model,
              TrainConfig(steps=2, timeout_s=30, checkpoint_dir=folder, checkpoint_every=1))
    return [run_job(job, rank, world)]


def test_a_full_disk_stops_every_rank_before_the_write(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        launch_task(full_disk_task, (str(tmp_path),), 2, timeout_s=30)
    text = str(info.value)
    assert "checkpoint of step 2 not written" in text and "64.00 KiB free" in text, text
    assert "PeerError" not in text and "dead or stuck" not in text, text  # all ranks agreed
    assert not (tmp_path / "step-00000002").exists()  # not a byte of it written
    assert [m.step for m in ck.complete(tmp_path)] == [1]


def test_cli_resume_with_every_step_done_needs_no_room(
        tmp_path: Path, capfd: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from flexpipe.cli.main import main

    args = ["run", "zb-h1", "-p", "2", "-m", "2", "--checkpoint-dir", str(tmp_path), *TINY]
    assert main([*args, "--steps", "2"]) == 0
    capfd.readouterr()
    _full(monkeypatch, 4096)  # the launcher sees a nearly full disk
    code = main([*args, "--steps", "2"])
    err = capfd.readouterr().err
    assert code == 0 and "resuming from" in err and "every step already done" in err, err
    code = main([*args, "--steps", "3"])  # one more step: told, resumed, written (ranks' room)
    err = capfd.readouterr().err
    assert code == 0 and "4.00 KiB free" in err and "all the same" in err, err
    assert [m.step for m in ck.complete(tmp_path)] == [2, 3]


@pytest.mark.parametrize("blocker", ["step-00000003", "step-00000002/__0_0.distcp"])
def test_cli_a_blocked_step_folder_is_refused_before_training(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], blocker: str) -> None:
    from flexpipe.cli.main import main

    path = tmp_path / blocker
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir() if blocker.endswith(".distcp") else path.write_text("x")
    code = main(["run", "1f1b", "-p", "2", "-m", "2", "--steps", "3", "--checkpoint-every",
                 "2", "--checkpoint-dir", str(tmp_path), *TINY])
    err = capfd.readouterr().err
    assert code == 2 and str(path) in err and "checked before training" in err, err
    assert "step 1/" not in err and "Traceback" not in err, err


def test_cli_factory_building_other_weights_per_rank_is_refused(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from flexpipe.cli.main import main

    monkeypatch.chdir(Path(__file__).parent)
    code = main(["run", "gpipe", "-p", "2", "-m", "2", "--steps", "1", "--model",
                 "nan_models:per_rank_values", "--timeout", "30"])
    err = capfd.readouterr().err
    assert code != 0 and "rank 1 built other initial weights than rank 0" in err, err
    assert "parameter 2.bias differs" in err and "step 1/" not in err, err
