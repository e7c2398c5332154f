"""The runtime fails clearly and in time: a dead rank makes the others fail with a message
naming the problem (never a hang); a kind without a handler is named; and the ``flexpipe run``
command trains, reports a measured trace and stays within its timeout."""

from __future__ import annotations

import json
import os
import time

import pytest

from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.executor import check_supported
from flexpipe.runtime.launch import LaunchError, launch_task
from flexpipe.runtime.models import ModelSpec
from flexpipe.runtime.train import Job, TrainConfig, run_job
from flexpipe.schedules import registry

TINY = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)


def dying_task(rank: int, world: int) -> list[object]:
    """Rank 1 dies right after joining; rank 0 tries to train."""
    if rank == 1:
        os._exit(3)
    job = Job(registry.build("1f1b", 2, 2), TINY, TrainConfig(steps=1, timeout_s=5))
    return [run_job(job, rank, world)]


def test_dead_rank_fails_the_others_quickly() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch_task(dying_task, (), 2, timeout_s=5, deadline_s=60)
    assert time.monotonic() - t0 < 60
    message = str(info.value)
    assert "rank 0" in message and ("failed" in message or "timed out" in message), message


def test_missing_handler_is_named() -> None:
    ops = ((Op("AG", 0, 0), Op("F", 0, 0), Op("BW", 0, 0), Op("RS", 0, 0)),)
    schedule = Schedule.build(ops, Placement.linear(1), 1)
    with pytest.raises(ConfigError, match="no handler for op kind.*AG, RS"):
        check_supported(schedule)


def test_cli_run_reports_measured_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "zb-h1", "-p", "2", "-m", "3", "--steps", "2", "--layers", "2",
                 "--hidden", "16", "--seq", "8", "--vocab", "32", "--json", "--timeout", "30"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schedule"] == "zb-h1" and len(report["losses"]) == 2
    assert report["measured_makespan_ms"] > 0 and 0 <= report["measured_bubble_rate"] < 1
