"""The failure report of a torchrun rank counts the steps it completed although it never sees
the loss (the loss is on the last pipeline rank), and says up to which step the checkpoint
directory holds an intact checkpoint, so a job killed after step N's checkpoint does not read
"stopped after 0 completed steps"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli_calls import call
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes import saved


def _fake_torchrun(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    from flexpipe.runtime.processes import launch
    from flexpipe.runtime.processes.progress import StepReport

    def failing(jobs: Any, timeout_s: float = 60.0, on_step: Any = None) -> Any:
        for step in range(steps):  # rank 0 of 2: no loss here
            on_step(StepReport(0, step, None, 0.05, 2**20))
        raise launch.LaunchError("rank 1 lost (killed by signal SIGKILL)", 1)

    monkeypatch.setattr(launch, "run_torchrun", failing)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29999")):
        monkeypatch.setenv(key, value)


def _checkpoint(root: Path, step: int) -> None:
    """A complete checkpoint folder of ``step`` (its one data file a stand-in)."""
    folder = saved.staging(ck.step_dir(root, step))
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    files = {"__0_0.distcp": {"rank": 0, "bytes": 1, "sha256": saved.sha256(
        folder / "__0_0.distcp")}}
    saved.publish(folder, ck.step_dir(root, step), files, "SGD",
                  {"step": step, "samples": 0, "meta": {}, "layout": {}, "rng": []})


@pytest.mark.parametrize(("steps", "checkpointed"), [(3, 0), (9, 8), (1, 1)])
def test_a_torchrun_rank_without_the_loss_counts_its_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        steps: int, checkpointed: int) -> None:
    _fake_torchrun(monkeypatch, steps)
    folder = tmp_path / "ck"
    if checkpointed:
        _checkpoint(folder, checkpointed)
    argv = ("run", "1f1b", "-p", "2", "-m", "2", "--steps", "12", "--checkpoint-dir",
            str(folder))
    code, out, err = call(capsys, *argv)
    assert code == 2
    assert f"stopped after {steps} completed steps" in err and "rank 1 lost" in err, err
    assert ("checkpointed up to step" in err) == bool(checkpointed), err
    if checkpointed:
        assert f"checkpointed up to step {checkpointed} (the same command resumes" in err, err
    assert "loss -" not in out  # a rank without the loss prints no step lines
    code, out, err = call(capsys, *argv, "--json")
    report = json.loads(out)
    assert report["steps_completed"] == steps and report["steps_checkpointed"] == checkpointed
