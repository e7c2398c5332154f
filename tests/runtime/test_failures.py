"""The runtime fails clearly and in time: a dead rank makes the others fail with a message
naming the problem (never a hang); a kind without a handler is named; and the ``flexpipe run``
command trains, reports a measured trace and stays within its timeout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.handlers import HANDLERS, check_supported
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.faults import forward_fault
from flexpipe.runtime.processes.launch import LaunchError, launch_task
from flexpipe.runtime.processes.supervise import Child, Failure, judge
from flexpipe.runtime.processes.train import Job, TrainConfig, run_job
from flexpipe.schedules import registry

TINY = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)


def faulty_task(rank: int, world: int, victim: int, fault: str, at_forward: int,
                timeout_s: float, stamp: str) -> list[object]:
    """Train 1F1B for 3 steps; rank ``victim`` dies (SIGKILL) or stalls (sleeps) when it starts
    its ``at_forward``-th forward, i.e. in the middle of step 1, after writing the time to the
    file ``stamp``."""
    hooked = forward_fault(fault, at_forward, stamp=stamp) if rank == victim else None
    job = Job(registry.build("1f1b", world, 4), TINY,
              TrainConfig(steps=3, timeout_s=timeout_s))
    return [run_job(job, rank, world, handlers=hooked)]


def _check_failure(info: pytest.ExceptionInfo[LaunchError], victim: int, world: int,
                   how: str) -> None:
    """The launch names the victim, every other rank exited non-zero naming it, and no
    process is left."""
    err = info.value
    lines = str(err).splitlines()
    assert err.culprit == victim and lines[0].startswith(f"rank {victim} {how}"), str(err)
    assert sorted(err.exit_codes) == list(range(world)), err.exit_codes
    assert all(code not in (None, 0) for code in err.exit_codes.values()), err.exit_codes
    for r in range(world):
        if r != victim:
            assert f"rank {victim}" in lines[1 + r].split(":", 1)[1], str(err)
    for pid in err.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("world,victim", [(2, 1), (4, 2)])
def test_rank_killed_mid_step_is_named_and_stops_the_others(world: int, victim: int,
                                                            tmp_path: Path) -> None:
    stamp = tmp_path / "fault"
    with pytest.raises(LaunchError) as info:  # seen at once: the ranks' 600 s timeout never ends
        launch_task(faulty_task, (victim, "kill", 6, 600.0, str(stamp)), world, timeout_s=600,
                    deadline_s=300)
    assert stamp.exists()
    _check_failure(info, victim, world, "lost (killed by signal SIGKILL")


def test_stalled_rank_is_named_after_the_timeout(tmp_path: Path) -> None:
    stamp = tmp_path / "fault"
    with pytest.raises(LaunchError) as info:
        launch_task(faulty_task, (1, "stall", 6, 5.0, str(stamp)), 2, timeout_s=5,
                    deadline_s=120)
    assert time.time() - float(stamp.read_text()) >= 5  # a lower bound: never declared early
    _check_failure(info, 1, 2, "stalled")


def test_rank_that_exits_0_mid_step_is_named(tmp_path: Path) -> None:
    """``os._exit(0)`` in a forward: the quiet rank is the culprit, not its waiting peer."""
    stamp = tmp_path / "fault"
    with pytest.raises(LaunchError) as info:  # seen at once: the 600 s timeout never ends
        launch_task(faulty_task, (1, "exit0", 6, 600.0, str(stamp)), 2, timeout_s=600,
                    deadline_s=300)
    err = info.value
    first, *ranks = str(err).splitlines()
    assert err.culprit == 1 and first.startswith("rank 1 lost (exit code 0, without "
                                                 "reporting a result"), str(err)
    assert err.exit_codes[1] == 0 and err.exit_codes[0] not in (None, 0), err.exit_codes
    assert "rank 1 lost" in ranks[0] and "finished" not in ranks[1], str(err)


def test_a_rank_gone_without_a_report_is_lost_whatever_its_exit_code() -> None:
    for code in (0, 1, -9):
        assert _child(0, code, None).lost and _child(0, code, []).lost
        assert not _child(0, code, ["result"]).lost
    assert not _child(0, None, None).lost
    assert judge([_child(0, None, None), _child(1, 0, None)], 5).text.startswith(
        "rank 1 lost (exit code 0, without reporting a result")


def _child(rank: int, exitcode: int | None, report: list[object] | None) -> Child:
    proc = SimpleNamespace(exitcode=exitcode)
    return Child(rank, proc, None, None, report, 0.0 if exitcode is not None else None)  # type: ignore[arg-type]


def _ranks(rank: int, world: int) -> list[object]:
    return [(rank, world)]


def test_a_taken_rendezvous_port_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds the port the launch chose before rank 0 binds it (two launches at
    once): the ranks never join, so the launch starts again on another port."""
    import socket

    from flexpipe.runtime.processes import launch

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    ports = [held.getsockname()[1]]
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: ports.pop() if ports else real())
    try:
        assert launch_task(_ranks, (), 2, timeout_s=20) == [[(0, 2)], [(1, 2)]]
    finally:
        held.close()
    assert not ports  # the taken port was tried first


def _blank_first_line(rank: int, world: int, wrapped: bool) -> list[Any]:
    if rank == 1:
        try:
            try:
                raise StopIteration
            except StopIteration as stop:
                raise RuntimeError("\nExpected positional argument for x\n\nWhile ...") \
                    from stop
        except RuntimeError as inner:
            if wrapped:
                raise RuntimeError("[Stage 0] failed to run forward:\nargs: ...") from inner
            raise
    return [rank]


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_message_starting_with_a_blank_line_is_still_shown(wrapped: bool) -> None:
    """torch.fx's errors start with a newline, and torch's pipelining wraps them: the verdict
    shows the first line that says something, and the deepest cause that says something."""
    with pytest.raises(LaunchError) as err:
        launch_task(_blank_first_line, (wrapped,), 2, timeout_s=20)
    first = str(err.value).splitlines()[0]
    fx = "RuntimeError: Expected positional argument for x"
    assert first == ("rank 1 failed: RuntimeError: [Stage 0] failed to run forward: "
                     f"(from {fx})" if wrapped else f"rank 1 failed: {fx}")


ONE_PROCESS = """
import socket, torch
def refuse(self, *a, **k):
    raise OSError(98, "Address already in use")
socket.socket.bind = refuse  # no port can be had
import flexpipe
torch.manual_seed(0)
pipe = flexpipe.pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)], "1f1b", m=2,
                         loss_fn=torch.nn.functional.cross_entropy)
loss = pipe.step(torch.randn(4, 4), torch.tensor([0, 1, 1, 0]))
print("loss", float(loss))
"""


def test_a_one_process_pipeline_needs_no_port() -> None:
    """``flexpipe.pipeline`` outside any launcher makes a group of one process: it meets in
    memory, so it runs where no port can be bound (a taken or a forbidden one)."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", ONE_PROCESS], env=env, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("loss ")


def test_judge_names_the_rank_at_fault() -> None:
    waited = [Failure(0, "PeerError: from rank 1", peer=1, about_peer=True)]
    stalled = [_child(0, None, waited), _child(1, None, None), _child(2, None, None)]
    assert judge(stalled, 5).text == "rank 1 stalled: rank 0 waited for it past the 5s timeout"
    lost = [_child(0, None, waited), _child(1, None, None), _child(2, -9, None)]
    assert judge(lost, 5).text == "rank 2 lost (killed by signal SIGKILL, exit code -9)"
    chain = [_child(0, None, waited), _child(1, None, [Failure(1, "from 2", 2, about_peer=True)]),
             _child(2, None, None)]
    assert judge(chain, 5).text == "rank 2 stalled: rank 1 waited for it past the 5s timeout"
    raised = [_child(0, 1, waited), _child(1, 1, [Failure(1, "ValueError: bad")])]
    assert judge(raised, 5).culprit == 1 and "ValueError: bad" in judge(raised, 5).text


def test_missing_handler_is_named() -> None:
    ops = ((Op("AG", 0, 0), Op("F", 0, 0), Op("BW", 0, 0), Op("RS", 0, 0)),)
    schedule = Schedule.build(ops, Placement.linear(1), 1)
    table = {k: v for k, v in HANDLERS.items() if k not in ("AG", "RS")}
    with pytest.raises(ConfigError, match="no handler for op kind.*AG, RS"):
        check_supported(schedule, table)


def test_cli_run_reports_measured_trace(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["run", "zb-h1", "-p", "2", "-m", "3", "--steps", "2", "--layers", "2",
                 "--hidden", "16", "--seq", "8", "--vocab", "32", "--json", "--timeout", "30"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schedule"] == "zb-h1" and len(report["losses"]) == 2
    assert report["measured_makespan_ms"] > 0 and 0 <= report["measured_bubble_rate"] < 1
