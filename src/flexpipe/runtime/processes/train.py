"""Training with a pipeline schedule, on one rank of an initialised process group: build this
rank's stages, run the executor step after step (gradient accumulation over micro-batches with
the loss averaged like the single-device run), average gradients over data-parallel replicas,
step the optimizer. The rank itself (device, links, data-parallel group, FSDP shards, executor)
is set up by ``flexpipe.runtime.execution.worker.RankWorker``, as for the public ``Pipeline``.
``reference.reference_run`` is the same training on one device, for comparison.

Rank layout: global rank = replica x pipeline ranks + pipeline rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.lower import lower
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.data.corpus import DataConfig
from flexpipe.runtime.execution.collector import collect_after, collector_paused
from flexpipe.runtime.execution.executor import Handler
from flexpipe.runtime.execution.handlers import HANDLERS
from flexpipe.runtime.execution.parallel import Parallel
from flexpipe.runtime.execution.precision import MixedPrecision
from flexpipe.runtime.execution.segments import build_graph_stages
from flexpipe.runtime.execution.stage import LossFn, StageModule
from flexpipe.runtime.execution.twoway import build_two_way_stages
from flexpipe.runtime.execution.worker import RankWorker
from flexpipe.runtime.models.kinds import (
    check_parallel,
    ep_plan,
    kind,
    model_segments,
    tp_plan,
)
from flexpipe.runtime.models.spec import ModelSpec, as_spec, fit_job, spec_model
from flexpipe.runtime.processes import stepping
from flexpipe.runtime.processes.checkpoint import Checkpointer, describe
from flexpipe.runtime.processes.jobcheck import agree_job, agree_weights, user_shapes
from flexpipe.runtime.processes.lrschedule import LRSchedule
from flexpipe.runtime.processes.numerics import guard_step
from flexpipe.runtime.processes.progress import StepReport, step_report
from flexpipe.runtime.transport import comm, groups
from flexpipe.runtime.transport.engines import is_sharded
from flexpipe.schedules.dualpipe_twoway import is_two_way


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
    """Data-parallel replicas of the pipeline (world size = dp x pipeline ranks x tp)."""
    dp_replicate: int = 1
    """HSDP: the ``dp`` ranks as this many replica groups of ``dp / dp_replicate`` FSDP2
    shards each (a schedule with AG/RS; 1: plain FSDP)."""
    tp: int = 1
    """Tensor-parallel ranks per pipeline rank (the model's ``tp_plan`` splits its layers)."""
    ep: int = 1
    """Expert-parallel ranks per pipeline rank: each MoE layer's experts shared out over them
    (the model's expert-parallel plan, ``kinds.ep_plan``); they train on data of their own,
    as replicas do (world size = dp x ep x pipeline ranks x tp)."""
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
    """Measure the live activation bytes after every op of the run's first step
    (``RankResult.activations``); the later steps run unmetered, so the last step's op times
    are free of the meter's own work."""
    on_nan: str = "stop"
    """A non-finite loss or gradient: ``stop`` (fail on every rank naming the step, rank,
    stage and parameter, before the update and any checkpoint) or ``skip`` (drop that step's
    update); ``flexpipe.runtime.processes.numerics``."""
    overlap_reduce: bool = True
    """Average each stage's gradients over the replicas as soon as they are final in the
    step, behind the compute still to come (False: all after the step)."""
    mixed_precision: MixedPrecision | None = None
    """Train on bfloat16 compute copies of float32 master weights (``precision``; None: the
    model's own dtype throughout)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.01
    """AdamW's weight decay (torch's default)."""
    lr_schedule: LRSchedule | None = None
    """Warm-up and decay of ``lr`` over the steps (None: constant)."""
    max_norm: float | None = None
    """Clip the gradients to this total norm over the whole model (None: no clipping)."""
    data: DataConfig | None = None
    """Train the built-in GPT on this token data (None: the synthetic text)."""
    val_every: int = 0
    """Take the validation loss on the held-out windows every this many steps and after the
    last (0: never; needs ``data``)."""

    @property
    def replicas(self) -> int:
        """Data replicas: the ``dp`` replicas times the ``ep`` expert-parallel ranks."""
        return self.dp * self.ep


@dataclass(frozen=True)
class _JobFields:
    """A ``Job``'s fields, as it holds them: its model a ``ModelSpec`` and its schedule on
    that model's stage graph."""

    schedule: Schedule
    model: ModelSpec = field(default_factory=ModelSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    partition: tuple[int, ...] | None = None
    """Layers per stage, segment after segment for a graph model (None: as even as
    possible)."""


class Job(_JobFields):
    """One training run: a schedule, a model and how to train it."""

    def __init__(self, schedule: Schedule, model: ModelSpec | object | None = None,
                 train: TrainConfig | None = None,
                 partition: tuple[int, ...] | None = None) -> None:
        """``model``: a ``ModelSpec`` or your own model (a ``flexpipe.UserModel``, which
        becomes a ``user`` ``ModelSpec``, cut where ``flexpipe.pipeline`` would cut it when
        it names no split points; a chain schedule then takes the stage graph of the model
        cut at split points). None: the built-in GPT's defaults."""
        spec = ModelSpec() if model is None else as_spec(model)
        if kind(spec).own:
            spec, schedule = fit_job(schedule, spec, partition)
        super().__init__(schedule, spec, TrainConfig() if train is None else train, partition)

    @property
    def world(self) -> int:
        """Processes the job runs on: pipeline ranks x data-parallel replicas x ep x tp."""
        return self.schedule.num_ranks * self.train.replicas * self.train.tp


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
    """Live activation bytes after every op of the run's first step (the ops and their order
    are every step's; ``TrainConfig.measure_memory``)."""
    tp_rank: int = 0
    """This rank's index among the tensor-parallel ranks of its pipeline rank."""
    param_bytes: list[float] = field(default_factory=list)
    """Parameter and gradient bytes after every op of the run's first step
    (``measure_memory``)."""
    static_bytes: float = 0.0
    """Bytes of the parameters, gradients, optimizer state and compute copies held after the
    last step (``measure_memory``; ``RankWorker.static_bytes``)."""
    comm: list[float] = field(default_factory=list)
    """Seconds each op of the last step spent inside the experts' all-to-alls."""
    val_losses: dict[int, float | None] = field(default_factory=dict)
    """The validation loss taken after a step, by step (None on a rank without a last
    stage)."""


def make_optimizer(params: Iterable[torch.Tensor], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg`` (DTensor shards and plain tensors in separate parameter
    groups: a fused update takes one kind at a time)."""
    groups = param_groups(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
    raise ConfigError(f"unknown optimizer {cfg.optimizer!r} (sgd, adamw)")


def param_groups(params: Iterable[torch.Tensor]) -> list[dict[str, list[torch.Tensor]]]:
    """``params`` as optimizer parameter groups: the plain tensors, then the DTensor shards
    (FSDP2, tensor parallel); empty groups left out."""
    params = list(params)
    kinds = ([p for p in params if not is_sharded(p)], [p for p in params if is_sharded(p)])
    return [{"params": group} for group in kinds if group] or [{"params": []}]


def build_rank(job: Job, pipe_rank: int) -> tuple[dict[int, StageModule], LossFn]:
    """This rank's stages and the model's loss (the model's stage graph must be the
    schedule's)."""
    segments, loss_fn = model_segments(job.model)
    keep = job.schedule.placement.rank_stages[pipe_rank]
    if is_two_way(job.schedule):  # two copies of the model stages, one per direction
        return build_two_way_stages(segments, job.partition, job.schedule, keep), loss_fn
    stages = build_graph_stages(segments, job.partition, job.schedule.num_stages, keep,
                                job.schedule.graph)
    return stages, loss_fn


@dataclass
class _Run:
    """One job set up on this rank: its worker, optimizer, checkpointing and result so far."""

    job: Job
    worker: RankWorker
    opt: torch.optim.Optimizer
    ckpt: Checkpointer | None
    result: RankResult
    validator: stepping.Validator | None = None
    position: stepping.Position = field(default_factory=stepping.Position)
    """Where the data stood when the run started (its step and the global samples read)."""

    def step(self, step: int, on_step: Callable[[StepReport], None] | None) -> None:
        """Train one step (the collector paused), collect after it, take the validation loss
        when it is due, report and checkpoint."""
        with collector_paused():
            _train_step(self.job, self.worker, self.opt, step, self.result,
                        self.position.at(step, self.job))
        collect_after(step)  # outside the timed step
        val = None
        if self.validator is not None and self.validator.due(step):
            val = self.result.val_losses[step] = self.validator.loss()
        if on_step is not None:
            on_step(step_report(self.worker.rank, step, self.result.losses[-1],
                                self.result.step_times[-1], self.worker.device, val))
        if self.ckpt:
            self.ckpt.after(step, self.worker.stages, self.opt,
                            self.position.at(step + 1, self.job))

    def finish(self) -> RankResult:
        """The result, with the final parameters when the job captures them."""
        if self.job.train.capture:
            self.result.params = self.worker.named(grads=False)
        if self.job.train.measure_memory:
            self.result.static_bytes = self.worker.static_bytes(self.opt)
        return self.result


def _prepare(job: Job, rank: int, world: int, handlers: Mapping[str, Handler] | None) -> _Run:
    """Set ``job`` up on global ``rank``: its stages, worker, optimizer and checkpoint (resumed
    from the newest one if any)."""
    pp = job.schedule.num_ranks
    if kind(job.model).own and job.model.user is None:  # call its factory once
        job = replace(job, model=replace(job.model, user=spec_model(job.model)))
    agree_job(job, user_shapes(job.model.user))  # every rank was given this job
    if job.model.user is not None:  # and a factory built the same weights on every rank
        agree_weights(job.model.user.module)
    cfg = job.train
    if world != job.world:
        raise ConfigError(f"world size {world} != {pp} pipeline ranks x {cfg.dp} replicas x "
                          f"ep {cfg.ep} x tp {cfg.tp}")
    check_parallel(job.model, pp, cfg.dp, cfg.tp)
    parallel = Parallel(cfg.dp, cfg.tp, plan=tp_plan(job.model, cfg.tp),
                        overlap_reduce=cfg.overlap_reduce, ep=cfg.ep,
                        ep_plan=ep_plan(job.model, cfg.ep), dp_replicate=cfg.dp_replicate)
    stages, loss_fn = build_rank(job, (rank // cfg.tp) % pp)
    table = HANDLERS if handlers is None else handlers
    worker = RankWorker(lower(job.schedule), rank, world, stages, loss_fn, handlers=table,
                        timeout_s=cfg.timeout_s, lookahead=cfg.lookahead, seed=cfg.seed,
                        measure_memory=cfg.measure_memory, parallel=parallel,
                        mixed_precision=cfg.mixed_precision)
    opt = make_optimizer(worker.optimized, cfg)
    ckpt = _checkpointer(job, rank, worker.replica)
    stacked = ckpt is not None and any(sh.stacked for sh in worker.experts)
    if comm.complaints("stacked experts" if stacked else None):
        raise ConfigError("--checkpoint-dir with 'stacked' expert-parallel modules (each ep "
                          "rank's rows of one tensor) is not supported yet; 'list' experts are")
    start, samples = ckpt.resume(worker.stages, opt) if ckpt else (0, 0)
    worker.executor.steps_done = start  # the step number seeds the random numbers
    result = RankResult(rank, worker.pipe_rank, worker.replica, [], [], [], [],
                        start_step=start, tp_rank=worker.grid.coords["tp"])
    validator = stepping.Validator(job, worker) if cfg.val_every else None
    return _Run(job, worker, opt, ckpt, result, validator, stepping.Position(start, samples))


def run_job(job: Job, rank: int, world: int,
            on_step: Callable[[StepReport], None] | None = None,
            handlers: Mapping[str, Handler] | None = None) -> RankResult:
    """Train ``job`` on global ``rank`` of ``world`` (process group already initialised);
    ``on_step`` gets this rank's report of every step as it ends; ``handlers``: the executor's
    dispatch table (None: the standard ``HANDLERS``)."""
    with groups.own_groups(job.train.timeout_s):  # this job's groups end with it
        run = _prepare(job, rank, world, handlers)
        for step in range(run.result.start_step, job.train.steps):
            run.step(step, on_step)
        return run.finish()


def run_interleaved(jobs: Sequence[Job], rank: int, world: int,
                    on_step: Callable[[StepReport], None] | None = None) -> list[RankResult]:
    """Train ``jobs`` side by side on global ``rank``: all set up first, then step k of every
    job in turn, a different job first at each k (rotating), so that the machine's drift
    over the run reaches every job alike and their step times compare pair by pair (one
    result per job, in ``jobs``' order; each job's own steps, resumes and reports as in
    ``run_job``)."""
    with groups.own_groups(max((job.train.timeout_s for job in jobs), default=60.0)):
        runs = [_prepare(job, rank, world, None) for job in jobs]
        for k in range(max((job.train.steps for job in jobs), default=0)):
            lead = k % len(runs)
            for run in runs[lead:] + runs[:lead]:
                if run.result.start_step <= k < run.job.train.steps:
                    run.step(k, on_step)
        return [run.finish() for run in runs]


def _train_step(job: Job, worker: RankWorker, opt: torch.optim.Optimizer, step: int,
                result: RankResult, first: int) -> None:
    """One optimizer step on the data from global sample ``first`` on: the schedule's
    micro-batches, the gradient and loss average over the replicas, the update; its loss,
    time and op times go into ``result``."""
    opt.zero_grad(set_to_none=False)
    batch = stepping.step_batch(job, worker, first)
    stepping.set_lr(opt, job.train, step)
    comm.barrier(job.train.timeout_s)
    t0 = time.perf_counter()
    metered = step == result.start_step  # the first step: the last one is timed unmetered
    out = worker.run(batch, metered)
    sink = next((s for s in sorted(worker.stages) if s in job.schedule.graph.sinks()), None)
    update = guard_step(step, worker.rank, worker.stages, out.loss, job.train.on_nan,
                        worker.device, sink)
    loss = torch.tensor([out.loss if out.loss is not None else 0.0], dtype=torch.float64,
                        device=worker.device)
    worker.reduce_gradients([loss])
    if step == 0 and job.train.capture:
        result.grads = worker.named(grads=True)
    if update:
        stepping.clip(worker, job.train)
        opt.step()
    result.step_times.append(time.perf_counter() - t0)
    result.losses.append(float(loss) if out.loss is not None else None)
    result.starts, result.ends, result.comm = out.starts, out.ends, out.comm
    if metered:
        result.activations, result.param_bytes = out.activations, out.param_bytes


def _checkpointer(job: Job, rank: int, replica: int) -> Checkpointer | None:
    """The run's checkpointing (None without a checkpoint directory)."""
    cfg = job.train
    if cfg.checkpoint_dir is None:
        return None
    meta = describe(replace(job.model, user=None), cfg.optimizer)
    meta["data"] = cfg.data.describe() if cfg.data is not None else None  # older ones: None
    layout = {"pp": job.schedule.num_ranks, "dp": cfg.dp, "tp": cfg.tp,
              "stages": job.schedule.num_stages, **({"ep": cfg.ep} if cfg.ep > 1 else {})}
    return Checkpointer(Path(cfg.checkpoint_dir), cfg.checkpoint_every, cfg.steps, rank, meta,
                        cfg.timeout_s, layout, stepping.global_batch(job), replica)
