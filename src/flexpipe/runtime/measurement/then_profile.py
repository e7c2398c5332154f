"""Train, then profile on the same processes: ``flexpipe run --predict`` in one launch.

A prediction needs the model's profiled costs. Profiled in a launch of its own, it pays a
second start of every rank (the interpreter, torch, the process group: seconds on a CPU);
here the ranks that trained go on to time their stages (``profile.profile_task``) once the
last step has ended, so the training's steps are not disturbed by the profile and the
profile sees the machine the training saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flexpipe.cost.model import CostModel
from flexpipe.runtime.measurement.profile import REPS, Profiled, profile_task, to_cost_model
from flexpipe.runtime.processes.launch import check_job, launch_task, run_jobs
from flexpipe.runtime.processes.train import Job


def train_then_profile_task(rank: int, world: int, jobs: Sequence[Job],
                            profiled: Sequence[Profiled], reps: int,
                            progress: Callable[[Any], None] | None = None) -> list[Any]:
    """Launch task: ``jobs`` in turn (``launch.run_jobs``), then ``profiled``'s stages timed
    (``profile.profile_task``); the jobs' results, then the profiles'."""
    return [*run_jobs(rank, world, jobs, progress), *profile_task(rank, world, profiled, reps)]


def train_then_profile(job: Job, profiled: Profiled, *, threads: int = 1,
                       timeout_s: float = 60.0, on_update: Callable[[int, Any], None] | None
                       = None) -> tuple[list[Any], CostModel]:
    """Train ``job`` on ``job.world`` local processes, then profile ``profiled`` (its model on
    a placement of as many ranks) on them: every rank's result and the cost model."""
    placement = profiled[1]
    if placement.num_ranks != job.world:
        raise ValueError(f"the profile's placement has {placement.num_ranks} ranks, the job "
                         f"{job.world} processes: profile it in a launch of its own")
    check_job(job, job.world)
    per_rank = launch_task(train_then_profile_task, ([job], [profiled], REPS), job.world,
                           threads=threads, timeout_s=timeout_s, on_update=on_update)
    return [r[0] for r in per_rank], to_cost_model([r[1] for r in per_rank],
                                                   placement.num_stages)
