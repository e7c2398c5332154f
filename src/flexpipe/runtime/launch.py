"""Launching: one process per rank on this machine (spawned, gloo over 127.0.0.1), or joining a
torchrun launch when its environment variables are set. Several jobs can run in one launch
(one process group, jobs in turn), which keeps tests fast.

A rank that raises or dies makes the launch fail with that rank's error; the survivors fail
within the transfer timeout instead of hanging, and are terminated after ``deadline_s``.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from flexpipe.errors import FlexPipeError
from flexpipe.runtime import comm
from flexpipe.runtime.executor import check_supported
from flexpipe.runtime.graph_models import check_model_graph
from flexpipe.runtime.train import Job, RankResult, run_job

Results = list[list[RankResult]]  # [job][rank]
Task = Callable[..., list[Any]]


class LaunchError(FlexPipeError):
    """A rank failed; the message carries its error."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_jobs(rank: int, world: int, jobs: Sequence[Job]) -> list[RankResult]:
    """The task of ``launch``: every job in turn on this rank."""
    return [run_job(job, rank, world) for job in jobs]


def worker(rank: int, world: int, init_method: str, task: Task, args: tuple[Any, ...],
           out_dir: str, threads: int, timeout_s: float) -> None:
    """Entry point of one rank: join the group, run ``task(rank, world, *args)`` (a list of
    results), write them."""
    torch.set_num_threads(threads)
    results: list[Any] = []
    try:
        comm.init(rank, world, init_method=init_method, timeout_s=timeout_s)
        results += task(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        results.append(LaunchError(f"rank {rank}: {type(exc).__name__}: {exc}\n"
                                   + traceback.format_exc(limit=6)))
        _write(out_dir, rank, results)
        os._exit(1)  # do not wait for peers in the group's destructor
    _write(out_dir, rank, results)
    comm.shutdown()


def _write(out_dir: str, rank: int, results: list[Any]) -> None:
    path = Path(out_dir) / f"rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        pickle.dump(results, f)
    tmp.replace(path)


def launch(jobs: Sequence[Job], world: int, *, threads: int = 1, timeout_s: float = 60.0,
           deadline_s: float = 600.0) -> Results:
    """Run ``jobs`` on ``world`` spawned local processes; results per job and rank. Raises
    ``LaunchError`` naming the first failing rank. Schedules are validated first."""
    for job in jobs:
        check_job(job, world)
    per_rank = launch_task(run_jobs, (list(jobs),), world, threads=threads,
                           timeout_s=timeout_s, deadline_s=deadline_s)
    return [[per_rank[r][j] for r in range(world)] for j in range(len(jobs))]


def launch_task(task: Task, args: tuple[Any, ...], world: int, *, threads: int = 1,
                timeout_s: float = 60.0, deadline_s: float = 600.0) -> list[list[Any]]:
    """Run ``task(rank, world, *args)`` (a picklable function returning a list) on ``world``
    spawned processes in one gloo group; each rank's list."""
    with tempfile.TemporaryDirectory(prefix="flexpipe-run-") as out_dir:
        init = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.start_processes(worker, args=(world, init, task, args, out_dir, threads,
                                               timeout_s), nprocs=world, join=False,
                                 start_method="spawn")
        _join(ctx, deadline_s, grace_s=timeout_s + 10)
        per_rank = [_read(out_dir, r) for r in range(world)]
    errors = [e for rank in per_rank for e in rank if isinstance(e, BaseException)]
    if errors:
        raise LaunchError(str(errors[0]))
    return per_rank


def check_job(job: Job, world: int) -> None:
    """Fail before launching: an invalid schedule, an op kind without a handler, a stage
    graph that is not the model's, a world size that is not pipeline ranks x replicas."""
    from flexpipe.sim.validate import check

    check(job.schedule)
    check_supported(job.schedule)
    check_model_graph(job.model, job.partition, job.schedule.graph)
    if world != job.schedule.num_ranks * job.train.dp:
        raise LaunchError(f"{world} processes cannot run {job.schedule.num_ranks} pipeline "
                          f"ranks x {job.train.dp} data-parallel replicas")


def _join(ctx: mp.ProcessContext, deadline_s: float, grace_s: float) -> None:
    """Wait for every process. When one fails, the others get ``grace_s`` to notice (their
    waits time out) and report; whatever is still running after that, or after
    ``deadline_s``, is terminated."""
    end = time.monotonic() + deadline_s
    while any(p.is_alive() for p in ctx.processes):
        if any(p.exitcode not in (None, 0) for p in ctx.processes):
            end = min(end, time.monotonic() + grace_s)
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            break
        time.sleep(0.05)
    for p in ctx.processes:
        p.join(5)


def _read(out_dir: str, rank: int) -> list[Any]:
    path = Path(out_dir) / f"rank{rank}.pkl"
    if not path.exists():
        return [LaunchError(f"rank {rank} died or hung without reporting a result")]
    with path.open("rb") as f:
        return pickle.load(f)  # type: ignore[no-any-return]


def run_torchrun(jobs: Sequence[Job], timeout_s: float = 60.0) -> Results:
    """Run ``jobs`` on this process as one rank of a torchrun launch (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set); every rank's results per job,
    gathered on every rank."""
    env = comm.env_launch()
    if env is None:
        raise LaunchError("not launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, "
                          "MASTER_PORT are not all set)")
    rank, world = env
    for job in jobs:
        check_job(job, world)
    comm.init(rank, world, timeout_s=timeout_s)
    try:
        mine = [run_job(job, rank, world) for job in jobs]
        every = comm.all_gather_object(mine)
    finally:
        comm.shutdown()
    return [[every[r][j] for r in range(world)] for j in range(len(jobs))]
