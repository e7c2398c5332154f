"""Training with a pipeline schedule, on one rank of an initialised process group: build this
rank's stages, run the executor step after step (gradient accumulation over micro-batches with
the loss averaged like the single-device run), average gradients over data-parallel replicas,
step the optimizer. ``reference_run`` is the same training on one device, for comparison.

Rank layout: global rank = replica x pipeline ranks + pipeline rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.lower import lower
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution import fsdp
from flexpipe.runtime.execution.executor import Executor, Handler
from flexpipe.runtime.execution.rng import Draw, drawing
from flexpipe.runtime.execution.segments import build_graph_stages, forward_graph, plan_stages
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.models.graph import model_segments
from flexpipe.runtime.models.zoo import ModelSpec, make_batch
from flexpipe.runtime.processes.checkpoint import Checkpointer, describe
from flexpipe.runtime.processes.progress import StepReport, step_report
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.p2p import P2P


@dataclass(frozen=True)
class TrainConfig:
    """How to train."""

    steps: int = 3
    """Optimizer steps."""
    optimizer: str = "sgd"
    """``sgd`` (with momentum) or ``adamw``."""
    lr: float = 0.05
    """Learning rate."""
    momentum: float = 0.9
    """SGD momentum."""
    dp: int = 1
    """Data-parallel replicas of the pipeline (world size = dp x pipeline ranks)."""
    timeout_s: float = 60.0
    """Longest wait for another rank before failing."""
    lookahead: int = 2
    """Receives are posted this many ops ahead."""
    capture: bool = False
    """Return the first step's gradients and the final parameters (for tests)."""
    checkpoint_dir: str | None = None
    """Resume from the newest complete checkpoint here and write new ones (None: off)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: only after the last step)."""
    seed: int | None = None
    """Seed every layer's random numbers (dropout) per step, micro-batch and layer, so the
    masks do not depend on the schedule, the partition or a recompute (None: the global
    generator, with recomputes replaying their forward's state)."""
    measure_memory: bool = False
    """Measure the live activation bytes after every op (``RankResult.activations``)."""


@dataclass(frozen=True)
class Job:
    """One training run: a schedule, a model and how to train it."""

    schedule: Schedule
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    partition: tuple[int, ...] | None = None
    """Layers per stage, segment after segment for a graph model (None: as even as
    possible)."""

    def __post_init__(self) -> None:
        """Your own model (a ``flexpipe.UserModel``) becomes a ``user`` ``ModelSpec``; a
        chain schedule takes the stage graph of a model cut at split points."""
        from flexpipe.runtime.user.model import as_spec, fit_job

        if not isinstance(self.model, ModelSpec):
            object.__setattr__(self, "model", as_spec(self.model))
        if self.model.name == "user":
            object.__setattr__(self, "schedule",
                               fit_job(self.schedule, self.model, self.partition))


@dataclass
class RankResult:
    """What one rank reports: losses per step (sink ranks; else None), step times (s), the op
    start/end times of the last step, and with ``capture`` gradients and parameters by
    global name."""

    rank: int
    pipe_rank: int
    replica: int
    losses: list[float | None]
    step_times: list[float]
    starts: list[float]
    ends: list[float]
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    start_step: int = 0
    """The step the run started at (> 0 when it resumed from a checkpoint)."""
    activations: list[float] = field(default_factory=list)
    """Live activation bytes after every op of the last step (``TrainConfig.measure_memory``)."""


def make_optimizer(params: Iterable[torch.Tensor], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg``."""
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    raise ConfigError(f"unknown optimizer {cfg.optimizer!r} (sgd, adamw)")


def _layout(job: Job, rank: int, world: int) -> tuple[int, int, int, int]:
    """(pipeline ranks, replicas, pipeline rank, replica) of global ``rank``."""
    pp = job.schedule.num_ranks
    if world != pp * job.train.dp:
        raise ConfigError(f"world size {world} != {pp} pipeline ranks x {job.train.dp} replicas")
    return pp, job.train.dp, rank % pp, rank // pp


def _dp_group(pp: int, dp: int, pipe_rank: int) -> object:
    """This pipeline rank's data-parallel group (created collectively by every rank)."""
    if dp == 1:
        return None
    groups = comm.new_groups([[d * pp + r for d in range(dp)] for r in range(pp)])
    return groups[pipe_rank]


def build_rank(job: Job, pipe_rank: int) -> tuple[dict[int, StageModule], object]:
    """This rank's stages and the model's loss (the model's stage graph must be the
    schedule's)."""
    segments, loss_fn = model_segments(job.model)
    keep = job.schedule.placement.rank_stages[pipe_rank]
    stages = build_graph_stages(segments, job.partition, job.schedule.num_stages, keep,
                                job.schedule.graph)
    return stages, loss_fn


def run_job(job: Job, rank: int, world: int,
            on_step: Callable[[StepReport], None] | None = None,
            handlers: Mapping[str, Handler] | None = None) -> RankResult:
    """Train ``job`` on global ``rank`` of ``world`` (process group already initialised);
    ``on_step`` gets this rank's report of every step as it ends; ``handlers``: the executor's
    dispatch table (default ``flexpipe.runtime.execution.handlers.HANDLERS``)."""
    pp, dp, pipe_rank, replica = _layout(job, rank, world)
    if job.model.name == "user" and job.model.user is None:  # call its factory once
        from flexpipe.runtime.user.model import spec_model

        job = replace(job, model=replace(job.model, user=spec_model(job.model)))
    group = _dp_group(pp, dp, pipe_rank)
    stages, loss_fn = build_rank(job, pipe_rank)
    device = comm.device()
    stages = {s: m.to(device) for s, m in stages.items()}
    schedule = lower(job.schedule)
    p2p = P2P([replica * pp + r for r in range(pp)], job.train.timeout_s, device)
    shards = fsdp.shard_stages(stages, group, dp, replica) \
        if fsdp.uses_fsdp(schedule.ranks[pipe_rank]) else {}
    ex = Executor(schedule, pipe_rank, stages, loss_fn, p2p,  # type: ignore[arg-type]
                  lookahead=job.train.lookahead, device=device, shards=shards,
                  seed=job.train.seed, replica=replica, measure_memory=job.train.measure_memory,
                  handlers=handlers)
    steps, params = fsdp.trainable(stages, shards)
    opt = make_optimizer(steps, job.train)
    ckpt = _checkpointer(job, rank, replica)
    if ckpt and shards:
        raise ConfigError("checkpointing a schedule with FSDP (AG/RS) is not supported")
    start = ckpt.resume(stages, opt) if ckpt else 0
    ex.steps_done = start  # the step number seeds the random numbers
    result = RankResult(rank, pipe_rank, replica, [], [], [], [], start_step=start)
    for step in range(start, job.train.steps):
        opt.zero_grad(set_to_none=False)
        batch = make_batch(job.model, step, schedule.microbatches, replica, dp)
        comm.barrier(job.train.timeout_s)
        t0 = time.perf_counter()
        out = ex.step(batch)
        loss = torch.tensor([out.loss if out.loss is not None else 0.0], dtype=torch.float64,
                            device=device)
        comm.all_reduce_mean([p.grad for p in params if p.grad is not None] + [loss], group, dp)
        if step == 0 and job.train.capture:
            result.grads = _named(stages, grads=True) | fsdp.full_named(shards, grads=True)
        opt.step()
        result.step_times.append(time.perf_counter() - t0)
        result.losses.append(float(loss) if out.loss is not None else None)
        if on_step is not None:
            on_step(step_report(rank, step, result.losses[-1], result.step_times[-1], device))
        result.starts, result.ends, result.activations = out.starts, out.ends, out.activations
        if ckpt:
            ckpt.after(step, stages, opt)
    if job.train.capture:
        result.params = _named(stages, grads=False) | fsdp.full_named(shards, grads=False)
    return result


def _checkpointer(job: Job, rank: int, replica: int) -> Checkpointer | None:
    """The run's checkpointing (None without a checkpoint directory)."""
    cfg = job.train
    if cfg.checkpoint_dir is None:
        return None
    meta = describe(replace(job.model, user=None), job.schedule.num_stages, cfg.optimizer)
    return Checkpointer(Path(cfg.checkpoint_dir), cfg.checkpoint_every, cfg.steps, rank, replica,
                        job.schedule.num_stages, meta, cfg.timeout_s)


def _named(stages: dict[int, StageModule], grads: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        for name, p in stage.named_global_parameters().items():
            t = p.grad if grads else p
            out[name] = (torch.zeros_like(p) if t is None else t).detach().cpu().clone()
    return out


@dataclass
class Reference:
    """The single-device run: losses per step, first-step gradients, final parameters."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def reference_run(model: ModelSpec, train: TrainConfig, microbatches: int) -> Reference:
    """Train the whole model on one device on the same data (all replicas' micro-batches);
    a graph model runs segment by segment (one stage each)."""
    segments, loss_fn = model_segments(model)
    sizes = [len(seg.layers) for seg in segments]
    graph = plan_stages(segments, sizes, len(sizes)).graph
    whole = build_graph_stages(segments, sizes, len(sizes))
    opt = make_optimizer([p for s in whole.values() for p in s.parameters()], train)
    ref = Reference([], {}, {})
    count = microbatches * train.dp
    for step in range(train.steps):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for replica in range(train.dp):
            batch = make_batch(model, step, microbatches, replica, train.dp)
            for mb, (inputs, target) in enumerate(batch):
                draw = None if train.seed is None else \
                    Draw(train.seed, step, replica * microbatches + mb)
                with drawing(draw):
                    outs = forward_graph(whole, graph, inputs).values()
                loss = torch.stack([loss_fn(*out, target) for out in outs]).sum() / count
                loss.backward()
                total += loss.item()
        if step == 0:
            ref.grads = _named(whole, grads=True)
        opt.step()
        ref.losses.append(total)
    ref.params = _named(whole, grads=False)
    return ref
