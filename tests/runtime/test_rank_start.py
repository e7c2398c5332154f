"""Ranks forked from the launcher's fork server (``runtime.processes.rankstart``) start as
spawned ones would: with the launcher's environment and output as they are at this launch (not
at the server's start), the launcher's ``sys.path``, and their arguments by value, however many
tensors they hold; ``FLEXPIPE_START_METHOD`` chooses spawn, and a wrong value is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.runtime.processes import rankstart

KEY = "FLEXPIPE_TEST_RANK_START"


def _env_and_print(key: str) -> str | None:
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} says hello", flush=True)
    print(f"rank {dist.get_rank()} warns", file=sys.stderr, flush=True)
    return os.environ.get(key)


def _sum_and_mutate(tensors: list[torch.Tensor]) -> float:
    total = float(sum(t.sum() for t in tensors))
    for t in tensors:
        t.add_(1.0)
    return total


def _path_has(entry: str) -> bool:
    return entry in sys.path


def test_a_rank_sees_this_launch_s_environment_and_writes_to_its_output(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    with capfd.disabled():  # the server starts with KEY unset and another output
        flexpipe.spawn(_path_has, 2, "")
    monkeypatch.setenv(KEY, "set after the first launch")
    assert flexpipe.spawn(_env_and_print, 2, KEY) == ["set after the first launch"] * 2
    out, err = capfd.readouterr()
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
    assert "rank 1 warns" in err, err


def test_arguments_travel_by_value_however_many_tensors() -> None:
    tensors = [torch.full((3,), float(k)) for k in range(400)]  # more than a socket's fds
    assert flexpipe.spawn(_sum_and_mutate, 2, tensors) == [3.0 * sum(range(400))] * 2
    assert all(float(t[0]) == k for k, t in enumerate(tensors))  # the ranks had copies


def test_a_rank_has_the_launcher_s_path_at_this_launch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    flexpipe.spawn(_path_has, 1, "")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert flexpipe.spawn(_path_has, 1, str(tmp_path)) == [True]


def test_spawn_is_asked_for_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXPIPE_START_METHOD", "spawn")
    monkeypatch.setenv(KEY, "spawned")
    assert rankstart.context().get_start_method() == "spawn"
    assert flexpipe.spawn(_env_and_print, 1, KEY) == ["spawned"]


def test_a_start_method_other_than_the_two_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXPIPE_START_METHOD", "fork")
    with pytest.raises(ConfigError, match="FLEXPIPE_START_METHOD='fork'.*forkserver"):
        flexpipe.spawn(_path_has, 1, "")


CLOSED = """
import sys, flexpipe, test_rank_start as t
if __name__ == "__main__":
    sys.stderr.write(f"ranks said {flexpipe.spawn(t._path_has, 1, sys.path[-1])}")
"""


def test_a_launcher_whose_output_is_closed_still_launches() -> None:
    """As a spawned rank did: a launcher started with ``>&-`` (its stdout closed)."""
    done = subprocess.run([sys.executable, "-c", CLOSED], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300,
                          cwd=Path(__file__).parent, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and "ranks said [True]" in done.stderr, done.stderr
