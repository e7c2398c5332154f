"""Launching: one process per rank on this machine (forked from a server that imported torch
once: ``rankstart``; gloo over 127.0.0.1), or joining a torchrun launch when its environment
variables are set. Several jobs can run in one launch (one process group, jobs in turn), which
keeps tests fast.

Local launches are supervised (``flexpipe.runtime.processes.supervise``): a rank that raises,
dies or stalls past the transfer timeout makes the launch fail with a ``LaunchError`` naming that
rank; every other rank is stopped (exits non-zero) within seconds and no process is left behind.
Results come back over pipes, never through files.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from flexpipe.errors import RunError
from flexpipe.runtime.execution.fsdp import check_replicate
from flexpipe.runtime.execution.handlers import check_supported
from flexpipe.runtime.execution.twoway import check_two_way_job, model_graph
from flexpipe.runtime.models.kinds import check_model_graph, check_parallel, ep_plan, kind
from flexpipe.runtime.processes import rankstart
from flexpipe.runtime.processes.allocator import keep_freed_memory
from flexpipe.runtime.processes.jobcheck import agree_job
from flexpipe.runtime.processes.rankstart import RankStart
from flexpipe.runtime.processes.supervise import Reporter, Supervisor, Verdict, start
from flexpipe.runtime.processes.train import Job, RankResult, run_interleaved, run_job
from flexpipe.runtime.transport import comm, groups
from flexpipe.runtime.transport.experts import check_layout
from flexpipe.runtime.user.portable import portable

Results = list[list[RankResult]]  # [job][rank]
Task = Callable[..., list[Any]]


class LaunchError(RunError):
    """A rank failed; the message names it and says how every rank ended. ``culprit`` is that
    rank (None: none in particular), ``exit_codes`` every rank's exit code and ``pids`` their
    process ids (all reaped)."""

    def __init__(self, message: str, culprit: int | None = None,
                 exit_codes: dict[int, int | None] | None = None,
                 pids: list[int] | None = None) -> None:
        super().__init__(message)
        self.culprit = culprit
        self.exit_codes = exit_codes or {}
        self.pids = pids or []


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_jobs(rank: int, world: int, jobs: Sequence[Job],
             progress: Callable[[Any], None] | None = None) -> list[RankResult]:
    """The task of ``launch``: every job in turn on this rank; ``progress`` gets each step's
    ``StepReport``."""
    return [run_job(job, rank, world, on_step=progress) for job in jobs]


def run_side_by_side(rank: int, world: int, jobs: Sequence[Job],
                     progress: Callable[[Any], None] | None = None) -> list[RankResult]:
    """The task of ``launch(interleave=True)``: the jobs' steps in turn
    (``train.run_interleaved``)."""
    return run_interleaved(jobs, rank, world, on_step=progress)


def worker(rank: int, world: int, init_method: str, begin: RankStart, threads: int,
           timeout_s: float, stream: bool, results: Connection, control: Connection) -> None:
    """Entry point of one rank: take the launcher's environment and output and the task
    (``begin``), join the group, run ``task(rank, world, *args)`` (a list of results; with
    ``stream``, also ``progress=``, a function that sends an item to the launcher at once),
    send them to the launcher; a watchdog obeys the launcher's stop."""
    reporter = Reporter(rank, results, control)
    reporter.watch()
    try:
        task, args = begin.enter()
        torch.set_num_threads(threads)
        keep_freed_memory()
        comm.init(rank, world, init_method=init_method, timeout_s=timeout_s)
        extra = {"progress": reporter.progress} if stream else {}
        out = task(rank, world, *args, **extra)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        reporter.fail(exc)
    reporter.send(out)
    groups.shutdown()


def launch(jobs: Sequence[Job], world: int, *, threads: int = 1, timeout_s: float = 60.0,
           deadline_s: float = 600.0, interleave: bool = False,
           on_update: Callable[[int, Any], None] | None = None) -> Results:
    """Run ``jobs`` on ``world`` local processes; results per job and rank. Raises
    ``LaunchError`` naming the first failing rank. Schedules are validated first.
    ``on_update(rank, report)`` receives every rank's ``StepReport`` as the step ends
    (``flexpipe.runtime.processes.progress.StepLog.add`` folds them into steps). With
    ``interleave`` the jobs train side by side, step k of each in turn (to compare their step
    times pair by pair on the same machine state), else one after another."""
    for job in jobs:
        check_job(job, world)
    task = run_side_by_side if interleave else run_jobs
    per_rank = launch_task(task, (list(jobs),), world, threads=threads,
                           timeout_s=timeout_s, deadline_s=deadline_s, on_update=on_update)
    return [[per_rank[r][j] for r in range(world)] for j in range(len(jobs))]


PORT_TRIES = 3
"""Launches tried before giving up when the rendezvous port was taken before rank 0 bound it."""


def launch_task(task: Task, args: tuple[Any, ...], world: int, *, threads: int = 1,
                timeout_s: float = 60.0, deadline_s: float = 600.0,
                on_update: Callable[[int, Any], None] | None = None) -> list[list[Any]]:
    """Run ``task(rank, world, *args)`` (a picklable function returning a list) on ``world``
    local processes in one gloo group; each rank's list. With ``on_update`` the task also
    gets ``progress=``, and what a rank passes to it reaches ``on_update(rank, item)`` here
    while the task runs. The rendezvous port is free when chosen, but another process may take
    it before rank 0 binds it (two launches at once): then, before any rank has run the task,
    the launch starts again on another port (``PORT_TRIES`` in all)."""
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _launch_once(task, args, world, threads, timeout_s, deadline_s, on_update)
        except LaunchError as exc:
            if attempt == PORT_TRIES or not port_taken(exc):
                raise
    raise AssertionError("unreachable")


def port_taken(exc: LaunchError) -> bool:
    """Whether a launch failed only because its rendezvous port was in use when rank 0 came
    to bind it (no rank got into the process group, so none ran the task)."""
    text = str(exc)
    return "could not join" in text and ("EADDRINUSE" in text
                                         or "address already in use" in text.lower())


def _launch_once(task: Task, args: tuple[Any, ...], world: int, threads: int, timeout_s: float,
                 deadline_s: float, on_update: Callable[[int, Any], None] | None
                 ) -> list[list[Any]]:
    """One try of ``launch_task`` on a port free right now."""
    init = f"tcp://127.0.0.1:{free_port()}"
    stream = on_update is not None
    portable(args)
    begin = RankStart.here(rankstart.dumps((task, args)))
    children = start(rankstart.context(), world, worker,
                     (world, init, begin, threads, timeout_s, stream))
    sup = Supervisor(children, timeout_s, deadline_s, on_update=on_update)
    sup.run()
    silent = [c.rank for c in children if c.report is None]
    if sup.verdict is None and silent:
        sup.verdict = Verdict(silent[0], f"rank {silent[0]} exited without reporting a result")
    if sup.verdict is not None:
        raise LaunchError(sup.summary(), sup.verdict.culprit, dict(sup.exit_codes),
                          [c.pid for c in children])
    return [c.report or [] for c in children]


def check_job(job: Job, world: int) -> None:
    """Fail before launching: an invalid schedule, an op kind without a handler, a stage
    graph that is not the model's, what DualPipe does not run with yet, an ``ep`` the model's
    experts cannot be shared out over, what expert parallelism does not run with yet
    (``experts.check_layout``: tp > 1 with HSDP), a model without a tensor-parallel plan at
    tp > 1, a world size that is not pipeline ranks x replicas x ep x tp, HSDP replica groups
    that do not divide the replicas or shard nothing."""
    from flexpipe.sim.validate import check

    check(job.schedule)
    check_supported(job.schedule)
    check_two_way_job(job, kind(job.model).own)
    check_model_graph(job.model, job.partition, model_graph(job.schedule))
    check_parallel(job.model, job.schedule.num_ranks, job.train.dp, job.train.tp)
    check_replicate(job.schedule, job.train.dp, job.train.dp_replicate, "--dp-replicate")
    ep_plan(job.model, job.train.ep)  # the model has experts, and ep divides each layer's
    check_layout(job.train.ep, job.train.tp, job.train.dp_replicate)  # as the worker refuses
    if world != job.world:
        ep = job.train.ep
        why = f" (ep = {ep} does not divide the world size {world})" if world % ep else ""
        raise LaunchError(f"{world} processes cannot run {job.schedule.num_ranks} pipeline "
                          f"ranks x {job.train.dp} data-parallel replicas x ep {ep} x tp "
                          f"{job.train.tp}{why}")


def run_torchrun(jobs: Sequence[Job], timeout_s: float = 60.0,
                 on_step: Callable[[Any], None] | None = None) -> Results:
    """Run ``jobs`` on this process as one rank of a torchrun launch (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set); every rank's results per job,
    gathered on every rank. ``on_step`` gets this rank's ``StepReport`` of every step."""
    env = comm.env_launch()
    if env is None:
        raise LaunchError("not launched by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, "
                          "MASTER_PORT are not all set)")
    rank, world = env
    keep_freed_memory()
    comm.init(rank, world, timeout_s=timeout_s)
    try:
        for job in jobs:  # the ranks' jobs agree (named if not) before any rank judges its own
            agree_job(job)
            check_job(job, world)
        mine = [run_job(job, rank, world, on_step=on_step) for job in jobs]
        every = comm.all_gather_object(mine)
    finally:
        groups.shutdown()
    return [[every[r][j] for r in range(world)] for j in range(len(jobs))]
