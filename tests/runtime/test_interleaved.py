"""Jobs trained side by side (``launch(interleave=True)``): step k of every job in turn, a
different job first at each k, each job training exactly as it does alone."""

from __future__ import annotations

from typing import Any

import pytest

from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import LaunchError, launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.schedules import registry

TINY = ModelSpec("gpt", layers=4, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)


def _jobs(steps: tuple[int, ...]) -> list[Job]:
    names = ("1f1b", "zb-h1", "zb-v")
    return [Job(registry.build(name, 2, 4), TINY, TrainConfig(steps=n, seed=3))
            for name, n in zip(names, steps, strict=True)]


def test_side_by_side_trains_each_job_as_alone_and_interleaves_the_steps() -> None:
    jobs = _jobs((3, 3, 2))
    alone = launch(jobs, world=2)
    seen: list[Any] = []
    together = launch(jobs, world=2, interleave=True,
                      on_update=lambda rank, report: seen.append(report) if rank == 1 else None)
    for one, two in zip(alone, together, strict=True):
        assert [r.losses for r in one] == [r.losses for r in two]
        assert [len(r.step_times) for r in one] == [len(r.step_times) for r in two]
    # every job reports each of its steps: they arrive k by k (the third job has only 2)
    assert [r.step for r in seen] == [0, 0, 0, 1, 1, 1, 2, 2]


def test_side_by_side_refuses_a_bad_job_by_name() -> None:
    bad = Job(registry.build("1f1b", 2, 4), TINY, TrainConfig(steps=1))
    with pytest.raises(LaunchError, match="3 processes cannot run"):
        launch([bad], world=3, interleave=True)
