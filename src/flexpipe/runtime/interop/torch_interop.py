"""Running a FlexPipe schedule on torch.distributed.pipelining's own runtime.

The schedule is exported as torch's compute-only CSV (``flexpipe.ir.torch_csv``); each rank
wraps its FlexPipe stages (same model, partition and initial weights as ``train.run_job``) in
torch ``PipelineStage`` objects, and torch's ``_PipelineScheduleRuntime`` loads the CSV
(``_load_csv``: torch checks it, infers the stage -> rank mapping from the rows and adds its
own SEND/RECV actions) and runs one step. ``run_both`` runs FlexPipe's executor and torch's
runtime on the same process group, so the two can be compared loss for loss and gradient for
gradient.

What torch's runtime needs, checked before launching (``export_for_torch``, ``ConfigError``
otherwise): only F, B, W, BW ops; a chain of stages; every rank holding a stage; the last
stage's forwards in micro-batch order (torch indexes the losses by the order they were
computed); one data-parallel replica; a schedule torch's lowering can add communication to.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.torch_csv import to_torch_csv
from flexpipe.runtime.execution.stage import LossFn, StageModule, as_tuple
from flexpipe.runtime.models.kinds import make_batch
from flexpipe.runtime.processes.train import Job, RankResult, build_rank, run_job
from flexpipe.runtime.transport import comm


@dataclass
class TorchRank:
    """What one rank reports after torch's step: the mean loss over micro-batches (on the rank
    holding the last stage; else None) and the gradients of its parameters by global name."""

    rank: int
    loss: float | None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def export_for_torch(schedule: Schedule) -> str:
    """The compute-only CSV of ``schedule`` after checking that torch's runtime can run it;
    ``ConfigError`` naming the reason otherwise."""
    from flexpipe.sim.validate import check

    check(schedule)
    if not schedule.graph.is_chain:
        raise ConfigError(f"{_name(schedule)}: torch's runtime runs chains of stages only "
                          f"(edges {schedule.graph.edges})")
    empty = [r for r, stages in enumerate(schedule.placement.rank_stages) if not stages]
    if empty:
        raise ConfigError(f"{_name(schedule)}: rank(s) {empty} hold no stage; torch's runtime "
                          f"needs at least one stage on every rank")
    _check_loss_order(schedule)
    text = to_torch_csv(schedule)
    _torch_lowering(schedule, text)
    return text


def _name(schedule: Schedule) -> str:
    return f"schedule {schedule.name!r}" if schedule.name else "the schedule"


def _check_loss_order(schedule: Schedule) -> None:
    last = schedule.num_stages - 1
    rank = schedule.placement.rank_of(last)
    mbs = [op.mb for op in schedule.ranks[rank] if op.kind == "F" and op.stage == last]
    if mbs != sorted(mbs):
        raise ConfigError(f"{_name(schedule)}: rank {rank} runs the last stage's forwards in the "
                          f"order {mbs}; torch's runtime indexes losses by the order they are "
                          f"computed, so it needs micro-batch order")


def _torch_lowering(schedule: Schedule, text: str) -> None:
    """torch's own checks and communication lowering, without processes."""
    from torch.distributed.pipelining import schedules as ts

    actions = {r: [ts._Action.from_str(c) for c in row.split(",") if c]
               for r, row in enumerate(text.splitlines())}
    try:
        mapping = ts._validate_schedule(actions, schedule.num_ranks, schedule.num_stages,
                                        schedule.microbatches)
        ts._add_send_recv(actions, lambda s: mapping[s], schedule.num_stages)
    except (AssertionError, RuntimeError, KeyError) as exc:
        raise ConfigError(f"{_name(schedule)}: torch's runtime rejects it: {exc}") from None


def torch_step(job: Job, rank: int, world: int, csv_text: str) -> TorchRank:
    """One step of ``job`` on this rank by torch's runtime from the exported ``csv_text``
    (process group initialised; gradients scaled like FlexPipe's: mean over micro-batches)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    if world != job.schedule.num_ranks:
        raise ConfigError(f"torch's runtime runs one pipeline: world size {world} != "
                          f"{job.schedule.num_ranks} ranks (no data parallelism)")
    stages, loss_fn = build_rank(job, rank)
    num, m = job.schedule.num_stages, job.schedule.microbatches
    wrapped = [PipelineStage(mod, s, num, torch.device("cpu")) for s, mod in sorted(stages.items())]
    runtime = _PipelineScheduleRuntime(wrapped, m, loss_fn=_unpacking(loss_fn),  # type: ignore[arg-type]
                                       scale_grads=True)
    with tempfile.TemporaryDirectory(prefix="flexpipe-torch-") as tmp:
        path = Path(tmp) / "schedule.csv"
        path.write_text(csv_text, encoding="utf-8")
        runtime._load_csv(str(path))
    args, target = _whole_batch(job)
    losses: list[torch.Tensor] = []
    runtime.step(*(args if 0 in stages else ()), target=target, losses=losses,
                 return_outputs=False)
    loss = sum(float(x.detach()) for x in losses) / m if losses else None
    return TorchRank(rank, loss, _grads(stages))


def _unpacking(loss_fn: LossFn) -> LossFn:
    """torch passes the last stage's output as returned (a tuple here) to the loss."""
    def loss(output: Any, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(*as_tuple(output), target)
    return loss


def _whole_batch(job: Job) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Step 0's micro-batches joined into one batch (torch splits it back along dim 0)."""
    batch = make_batch(job.model, 0, job.schedule.microbatches)
    count = len(batch[0][0])
    args = tuple(torch.cat([inputs[i] for inputs, _ in batch]) for i in range(count))
    return args, torch.cat([target for _, target in batch])


def _grads(stages: dict[int, StageModule]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        for name, p in stage.named_global_parameters().items():
            out[name] = (torch.zeros_like(p) if p.grad is None else p.grad).detach().clone()
    return out


def both_task(rank: int, world: int, jobs: Sequence[Job],
              csvs: Sequence[str]) -> list[tuple[RankResult, TorchRank]]:
    """The task of ``run_both``: each job by FlexPipe's executor, then by torch's runtime."""
    out = []
    for job, text in zip(jobs, csvs, strict=True):
        ours = run_job(job, rank, world)
        comm.barrier(job.train.timeout_s)
        out.append((ours, torch_step(job, rank, world, text)))
        comm.barrier(job.train.timeout_s)
    return out


def run_both(jobs: Sequence[Job], *, timeout_s: float = 60.0,
             deadline_s: float = 600.0) -> list[tuple[list[RankResult], list[TorchRank]]]:
    """Launch one local process per rank and run every job's first step by FlexPipe and by
    torch; per job, (FlexPipe's ranks, torch's ranks). All jobs need the same rank count."""
    from flexpipe.runtime.processes.launch import check_job, launch_task

    if not jobs:
        return []
    world = jobs[0].schedule.num_ranks
    for job in jobs:
        if job.train.dp != 1 or job.schedule.num_ranks != world:
            raise ConfigError(f"run_both runs single pipelines of {world} ranks; "
                              f"{_name(job.schedule)} has {job.schedule.num_ranks} ranks x "
                              f"{job.train.dp} replicas")
    one_step = [replace(j, train=replace(j.train, steps=1, capture=True)) for j in jobs]
    for job in one_step:
        check_job(job, world)
    csvs = [export_for_torch(job.schedule) for job in one_step]
    per_rank = launch_task(both_task, (one_step, csvs), world, timeout_s=timeout_s,
                           deadline_s=deadline_s)
    return [([per_rank[r][j][0] for r in range(world)], [per_rank[r][j][1] for r in range(world)])
            for j in range(len(jobs))]
