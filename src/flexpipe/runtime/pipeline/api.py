"""The public pipeline API: ``flexpipe.pipeline(model, schedule, ...)`` gives, on each rank, a
``Pipeline`` with ``step(inputs, targets) -> loss`` (gradients accumulate into this rank's
parameters; your optimizer steps them) and ``eval(inputs) -> outputs`` (forward only), to call
inside your own training loop, under torchrun or ``flexpipe.spawn``.

The model is cut into the schedule's stages (``flexpipe.runtime.user.model``); every rank keeps
only the stages the schedule places on it and runs them through the same ``RankWorker`` as the
CLI's training loop. Inputs are needed only on the rank holding the first stage, targets only on
the rank computing the loss. World size = pipeline ranks x data-parallel replicas; replica
``d`` is global ranks ``d * p .. d * p + p - 1``, and gradients are averaged over replicas
after each step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError, RunError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution import clipping
from flexpipe.runtime.execution.executor import Executor
from flexpipe.runtime.execution.handlers import HANDLERS, check_supported
from flexpipe.runtime.execution.rng import drawing
from flexpipe.runtime.execution.segments import Segment, build_graph_stages, check_graph
from flexpipe.runtime.execution.stage import LossFn, StageModule, Tensors
from flexpipe.runtime.execution.worker import Parallel, RankWorker
from flexpipe.runtime.measurement.balance import split_layers
from flexpipe.runtime.pipeline import items, state
from flexpipe.runtime.processes.launch import launch_task
from flexpipe.runtime.processes.train import param_groups
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import full
from flexpipe.runtime.user.autocut import auto_points
from flexpipe.runtime.user.interface import (
    Interface,
    as_inputs,
    check_inputs,
    gather,
    loss_for,
    order_inputs,
)
from flexpipe.runtime.user.model import (
    UserModel,
    cut_model,
    fit_graph,
    layer_list,
    model_graph,
    original_names,
)
from flexpipe.sim.validate import check


class _EvalForward:
    """The F handler of an evaluation step: the stage forward without autograd; a sink stage's
    outputs are kept per micro-batch instead of going to the loss."""

    def __init__(self) -> None:
        self.outputs: dict[int, Tensors] = {}

    def __call__(self, ex: Executor, op: Op) -> None:
        ex.require_params(op)
        inputs, _ = ex.take_inputs(op)
        with torch.no_grad(), drawing(ex.draw(op)):
            out = ex.stages[op.stage](*inputs)
        if op.stage in ex.sinks:
            self.outputs[op.mb] = tuple(t.detach() for t in out)
        else:
            ex.hand_forward(op, out)


class Pipeline:
    """One rank's part of a pipelined model (made by ``pipeline``)."""

    def __init__(self, schedule: Schedule, stages: dict[int, StageModule],
                 loss_fn: LossFn | None, names: dict[int, str], *, rank: int, world: int,
                 seed: int | None, timeout_s: float, lookahead: int, owns_group: bool,
                 interface: Interface | None = None,
                 buffers: state.BufferNames | None = None,
                 parallel: Parallel | None = None,
                 loss_items: items.ItemCount | None = None) -> None:
        self.schedule, self.rank, self.world = schedule, rank, world
        self.loss_items = loss_items
        """How many items each micro-batch's loss averages over (None: weigh them alike)."""
        self.counts: list[float] = []
        """This step's item count per micro-batch (``_batch``)."""
        self.names = {g: names[id(p)] for stage in stages.values()
                      for g, p in stage.named_global_parameters().items() if id(p) in names}
        """The stages' global parameter names -> your model's (fixed before FSDP2 and tensor
        parallelism replace the parameter objects by DTensors)."""
        self.interface = interface or Interface()
        self.takes_targets = loss_fn is not None
        """Whether ``step`` takes targets (else the model computes its own loss)."""
        self.worker = RankWorker(schedule, rank, world, stages,
                                 loss_for(self.interface, loss_fn),
                                 handlers=HANDLERS, timeout_s=timeout_s, lookahead=lookahead,
                                 seed=seed, parallel=parallel)
        self.pipe_rank, self.replica, self.dp, self.tp = \
            self.worker.pipe_rank, self.worker.replica, self.worker.dp, self.worker.tp
        self.tp_rank = self.worker.grid.coords["tp"]
        """This rank's index among the tensor-parallel ranks of its pipeline rank."""
        self.device, self.stages = self.worker.device, self.worker.stages
        self.owns_group, self.model_names = owns_group, set(names.values())
        self.buffer_names = buffers or state.BufferNames()
        """Your model's buffers: id -> name, and which are persistent (in ``state_dict``)."""
        graph = schedule.graph
        self.first = [s for s in graph.sources() if s in self.stages]
        self.last = [s for s in graph.sinks() if s in self.stages]
        self._collect = _EvalForward()
        forward = schedule.with_ranks([[o for o in ops if o.kind == "F"]
                                       for ops in schedule.ranks])
        self.evaluator = self.worker.executor_for(forward, {**HANDLERS, "F": self._collect})

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank holds the first stage (``step``/``eval`` need the inputs here)."""
        return bool(self.first)

    @property
    def needs_targets(self) -> bool:
        """Whether ``step`` needs the targets here: this rank computes the loss, and with your
        ``loss_fn`` (a model computing its own loss from ``labels`` takes none)."""
        return bool(self.last) and self.takes_targets

    def parameters(self) -> list[torch.Tensor]:
        """What this rank's optimizer steps: its stages' parameters (FSDP: their shards)."""
        return list(self.worker.optimized)

    def param_groups(self) -> list[dict[str, list[torch.Tensor]]]:
        """``parameters()`` as optimizer parameter groups, plain tensors apart from DTensors
        (FSDP, tensor parallel): ``torch.optim.AdamW(pipe.param_groups())``. A fused
        (``foreach``) update takes one kind at a time."""
        return param_groups(self.worker.optimized)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters under their names in your model (``layers.3.linear1.weight``;
        a list of layers: ``3.weight``); a weight tied across stages once."""
        seen: set[int] = set()
        for stage in self.stages.values():
            for name, p in stage.named_global_parameters().items():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self.names.get(name, name), p

    def full_named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters under your model's names as whole tensors (the DTensor
        shards of FSDP and tensor parallelism gathered: every rank calls this together),
        detached copies."""
        return {name: full(p).detach().clone() for name, p in self.named_parameters()}

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (BatchNorm's running statistics, ...) under their names in your
        model (``stem.1.running_mean``), each once."""
        return state.rank_buffers(self.stages, self.buffer_names)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers under their names in your model (as
        your model's own ``state_dict`` names them; a tied weight once), detached tensors
        sharing their storage."""
        return state.collect(self.named_parameters(), self.named_buffers(),
                             self.buffer_names.persistent)

    def load_state_dict(self, sd: dict[str, Any],
                        strict: bool = True) -> tuple[list[str], list[str]]:
        """Copy this rank's parameters and buffers from ``sd`` (this rank's ``state_dict``,
        or your whole model's: other ranks' names are skipped). (missing, unexpected) names;
        ``strict``: a name of this rank missing, or one not in the model, is a ConfigError."""
        known = self.model_names | set(self.buffer_names.state_keys)
        return state.load_into(self.state_dict(), sd, known, strict)

    def save(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Checkpoint this rank's parameters and buffers (and ``optimizer``'s state) under
        your model's names to the torch.distributed.checkpoint directory ``path``: every rank
        calls it together and writes its own file; ``load`` reads it at any rank count."""
        state.save(self.state_dict(), path, optimizer, self._param_names())

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume from the checkpoint ``path`` written by ``save`` (at this or another number
        of ranks and stages): this rank's parameters and buffers in place, and ``optimizer``'s
        state (built on ``parameters()``). Every rank calls it together."""
        state.load(self.state_dict(), path, optimizer, self._param_names())

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.named_parameters()}

    def step(self, inputs: Any = None, targets: torch.Tensor | None = None,
             **named: torch.Tensor) -> torch.Tensor | None:
        """Train on one batch: forward and backward of its m micro-batches in the schedule's
        order; gradients accumulate into ``.grad`` (averaged over data-parallel replicas).
        ``inputs`` (a tensor or tuple, batch first) or keyword inputs (``input_ids=...,
        attention_mask=..., labels=...``) only where ``needs_inputs``, ``targets`` only where
        ``needs_targets``. The batch's mean loss where it is computed, else None. Every rank
        checks its call and they agree first: a bad call on any rank raises on all."""
        batch = self._agreed("step", inputs, named, targets, training=True)
        for m in self.stages.values():
            m.train()
        scale, share = None, None
        if self.loss_items is not None:  # every rank: the counts go to the loss's rank
            counts = items.shared(self.counts, self.schedule.microbatches,
                                  self.worker.grid.group("pp"), self.device)
            scale, share = items.weights(counts, self.dp, self.worker.group, self.device)
        out = self.worker.run(batch, weights=scale)
        self.worker.reduce_gradients()
        if out.loss is None:
            return None
        loss = out.loss if share is None else \
            out.loss / (self.dp * share) if share else float("nan")  # this replica's mean
        return torch.tensor(loss, dtype=torch.float64)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradients, as ``torch.nn.utils.clip_grad_norm_`` clips one
        process's: the norm over every rank's parameters (a tied weight counted once; FSDP2 and
        tensor-parallel shards over their mesh), every gradient scaled by the same factor.
        Call it on every rank after ``step``; returns the total norm (float64), the same on
        every rank (``flexpipe.runtime.execution.clipping``)."""
        worker = self.worker
        params = worker.optimized
        total = clipping.total_norm(clipping.owned(params, worker.tied),
                                    worker.grid.group("pp"), float(norm_type))
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RunError(f"the total norm of order {norm_type} of the gradients is "
                           f"{float(total)}: not finite, so they cannot be clipped")
        clipping.scale(params, max_norm, total)
        return total

    def eval(self, inputs: Any = None, **named: torch.Tensor) -> Any:
        """Forward only (no autograd, modules in eval mode): the model's outputs for the batch
        (micro-batches concatenated, in the model's own structure: a tensor, a tuple, a dict or
        a ``ModelOutput``) on the rank holding the last stage, else None."""
        batch = self._agreed("eval", inputs, named, None, training=False)
        for m in self.stages.values():
            m.eval()
        self._collect.outputs.clear()
        try:
            self.evaluator.step(batch)
        finally:
            for m in self.stages.values():
                m.train()
        if not self.last:
            return None
        parts = [self._collect.outputs[j] for j in range(self.schedule.microbatches)]
        return gather(parts, self.interface)

    def close(self) -> None:
        """Leave the process group if ``pipeline`` joined it (under torchrun)."""
        if self.owns_group:
            comm.shutdown()

    def _agreed(self, call: str, inputs: Any, named: dict[str, torch.Tensor], targets: Any,
                training: bool) -> list[Any]:
        """The batch of this call after every rank has checked its own and they agreed, before
        any message: a bad call on one rank raises the same ConfigError on all (naming each
        rank and its reason), so no rank pairs with another's next step."""
        try:
            batch, mine = self._batch(self._inputs(inputs, named), targets, training,
                                      named.get("labels")), None
        except ConfigError as exc:
            batch, mine = [], str(exc)
        state.agree(mine, f"Pipeline.{call}")
        return batch

    def _inputs(self, inputs: Any, named: dict[str, torch.Tensor]) -> Any:
        """Positional inputs as given, or keyword inputs in the order the model takes them."""
        if not named:
            return inputs
        if inputs is not None:
            raise ConfigError("give the inputs by position or by keyword, not both")
        return order_inputs(self.interface, named)

    def _batch(self, inputs: Any, targets: Any, training: bool, labels: Any = None
               ) -> list[Any]:
        """The batch cut into m micro-batches ((inputs, target) each; () and None where this
        rank does not read them), after checking what was given where; with ``loss_items``,
        each micro-batch's item count where this rank reads the targets (or, for a model's
        own loss, its ``labels`` input)."""
        m = self.schedule.microbatches
        _where("inputs", inputs, self.first, self.rank, self.schedule, "first stage")
        if training and self.takes_targets:
            _where("targets", targets, self.last, self.rank, self.schedule,
                   "last stage (the loss)")
        elif targets is not None:
            raise ConfigError("targets given, but the model computes its own loss (no loss_fn); "
                              "pass the labels as an input (labels=...)")
        xs = [_chunks(t, m, "inputs") for t in as_inputs(inputs)] if self.first else []
        if self.first:
            check_inputs(self.interface, tuple(x[0] for x in xs))
        ys = _chunks(targets, m, "targets") if training and self.needs_targets else [None] * m
        self.counts = self._counts(ys, labels) if training else []
        return [(tuple(x[j] for x in xs), ys[j]) for j in range(m)]

    def _counts(self, targets: list[Any], labels: Any) -> list[float]:
        """Each micro-batch's item count (``loss_items``) from the data this rank reads: the
        targets, or for a model's own loss the ``labels`` input on the first stage."""
        if self.loss_items is None:
            return []
        if self.takes_targets:
            return items.counts(self.loss_items, targets) if self.needs_targets else []
        if not self.first:
            return []
        if labels is None:
            raise ConfigError("loss_items counts the labels of a model computing its own "
                              "loss: give them by keyword (labels=...)")
        return items.counts(self.loss_items, _chunks(labels, self.schedule.microbatches,
                                                     "labels"))


def _where(what: str, value: Any, here: list[int], rank: int, schedule: Schedule,
           stage: str) -> None:
    """Refuse ``value`` missing on a rank that reads it, or given on one that does not."""
    owner = schedule.placement.stage_rank[schedule.graph.sources()[0] if what == "inputs"
                                          else schedule.graph.sinks()[-1]]
    if here and value is None:
        raise ConfigError(f"rank {rank} holds the {stage}: give the {what} here")
    if not here and value is not None:
        raise ConfigError(f"{what} given on rank {rank}, which does not hold the {stage} "
                          f"(pipeline rank {owner} does); pass None here, so that only that "
                          "rank reads the data")


def _chunks(t: Any, m: int, what: str) -> list[torch.Tensor]:
    """``t`` cut into ``m`` equal micro-batches along dimension 0."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{what} must be a tensor (or a tuple of tensors), got "
                          f"{type(t).__name__}")
    n = t.shape[0] if t.dim() else 0
    if n == 0 or n % m:
        raise ConfigError(f"{what}: a batch of {n} samples cannot be cut into the schedule's "
                          f"{m} micro-batches ({n} is not a multiple of {m})")
    return list(t.chunk(m))


def join_group(timeout_s: float) -> tuple[int, int, bool]:
    """(rank, world size, whether we joined the group here): the process group already set up
    (``flexpipe.spawn``, your own code) or torchrun's, joined now; with neither, a group of
    this one process (a one-rank schedule: the one-process pipeline, the reference)."""
    if comm.world_size():
        return comm.my_rank(), comm.world_size(), False
    env = comm.env_launch() or (0, 1)
    comm.init(env[0], env[1], timeout_s=timeout_s)
    return env[0], env[1], True


def resolve_schedule(schedule: Any) -> Schedule:
    """A ``Schedule``, or a search result's best schedule (names and files are read above the
    runtime, by ``flexpipe.api.pipeline`` through ``flexpipe.specs``)."""
    best = getattr(schedule, "best", getattr(schedule, "schedule", schedule))
    if not isinstance(best, Schedule):
        raise ConfigError(f"schedule must be a Schedule, a library name, a file, a DSL program "
                          f"or a search result, got {type(schedule).__name__}")
    return best


def build_pipeline(model: nn.Module | Sequence[nn.Module] | UserModel, schedule: Any, *,
                   loss_fn: LossFn | None = None, dp: int | None = None,
                   split_points: Sequence[str] = (), partition: str | Sequence[int] = "layers",
                   example: Any = None, seed: int | None = None, timeout_s: float = 60.0,
                   lookahead: int = 2, tp: int | None = None,
                   tp_plan: Mapping[str, str] | None = None, mesh: Any = None,
                   loss_items: items.ItemCount | None = None) -> Pipeline:
    """This rank's ``Pipeline`` of ``model`` under ``schedule`` (what ``flexpipe.pipeline``
    returns; here the schedule is a ``Schedule`` or a search result).

    ``model``: an ``nn.Sequential`` / list of layers (cut by ``partition``: ``layers`` even,
    ``flops`` counted on ``example``, the inputs of one micro-batch, ``params``, or layers per
    stage), any ``nn.Module`` with ``split_points`` (module names starting stages 1, 2, ...;
    none: points balancing the ranks' parameters), or a ``UserModel``. Every rank must build
    the same initial weights (seed torch first).
    ``dp``, ``tp``: data-parallel replicas and tensor-parallel ranks per pipeline rank (world
    size = the schedule's ranks x dp x tp; None: the ``mesh``'s, else 1); ``tp_plan``:
    module-name pattern -> ``colwise``/``rowwise`` (torch's ``ColwiseParallel`` /
    ``RowwiseParallel``; default: the ``UserModel``'s); ``mesh``: your own DeviceMesh with a
    ``pp`` dimension and optional ``dp``/``tp`` (None: FlexPipe builds ``dp x pp x tp``).
    ``loss_fn(*outputs, target)``: the mean loss of a micro-batch (``loss_fn(output,
    target)`` for a model returning a dict or a ``ModelOutput``; None: the model's own loss,
    from the ``labels`` it takes as an input). ``loss_items(target)``: how many items that
    mean averages over (Hugging Face's token mean: ``(target != -100).sum()``), so that each
    micro-batch weighs its share of the batch's items and the gradient is one device's on the
    whole batch (None: every micro-batch weighs 1 / m). ``example``: one micro-batch's inputs (a
    tensor, a tuple, or a dict of keyword inputs). ``seed``: per-layer dropout seeds, so
    masks do not depend on the schedule."""
    rank, world, owns = join_group(timeout_s)
    if isinstance(model, UserModel):
        loss_fn = loss_fn or model.loss_fn
        split_points = split_points or model.split_points
        if example is None and model.example is not None:
            example = model.example[0]
        model = model.module
    if isinstance(model, UserModel):
        tp_plan = model.tp_plan if tp_plan is None else tp_plan
    sched = resolve_schedule(schedule)
    if mesh is None and sched.num_ranks * (dp or 1) * (tp or 1) != world:
        hint = " (run the script under torchrun --nproc-per-node N, or inside " \
            "flexpipe.spawn(fn, N))" if world == 1 else ""
        raise ConfigError(f"the schedule has {sched.num_ranks} pipeline ranks; x dp {dp or 1} "
                          f"x tp {tp or 1} = {sched.num_ranks * (dp or 1) * (tp or 1)} "
                          f"processes, but the world has {world}{hint}")
    parallel = Parallel(dp, tp, mesh, dict(tp_plan or {}))
    grid = parallel.grid(sched.num_ranks, world, comm.device())
    parallel = Parallel(grid.dp, grid.tp, grid.mesh, parallel.plan)
    if not split_points and sched.num_stages > 1 and isinstance(model, nn.Module) \
            and layer_list(model) is None:
        # any other nn.Module without split points: points balancing the ranks' counted
        # FLOPs on the example (their parameters without one)
        split_points = auto_points(model, sched.placement.stage_rank, example)
    segments, interface = cut_model(model, tuple(split_points), example, sched.num_stages)
    loss_for(interface, loss_fn)  # a clear error now when there is no loss at all
    cut = _partition(model, segments, partition, sched, example,
                     bool(split_points) or layer_list(model) is None)
    sched = _fit(sched, model_graph(segments, cut, sched.num_stages))
    every = build_graph_stages(segments, cut, sched.num_stages, graph=sched.graph)
    _check_same_weights(model)
    keep = sched.placement.rank_stages[grid.coords["pp"]]
    return Pipeline(sched, {s: every[s] for s in keep}, loss_fn, original_names(model),
                    rank=rank, world=world, seed=seed, timeout_s=timeout_s,
                    lookahead=lookahead, owns_group=owns, interface=interface,
                    buffers=state.buffer_names(model), parallel=parallel,
                    loss_items=loss_items)


def _partition(model: nn.Module | Sequence[nn.Module], segments: list[Segment],
               how: str | Sequence[int], sched: Schedule,
               example: Any, traced: bool) -> tuple[int, ...] | None:
    """Layers per stage of a chain model (None for a traced one: one stage per piece)."""
    if traced:
        if len(segments) != sched.num_stages:
            raise ConfigError(f"{len(segments) - 1} split points make {len(segments)} stages; "
                              f"the schedule has {sched.num_stages}")
        return None
    layers = layer_list(model) or []
    inputs = None if example is None else as_inputs(example, "example inputs")
    return tuple(split_layers(layers, how, sched.placement.stage_rank, inputs))


def _fit(sched: Schedule, graph: StageGraph) -> Schedule:
    """The schedule on the model's stage graph (a chain schedule takes a model's forward skip
    edges); refused, naming the stage, when the graphs differ otherwise."""
    fitted = fit_graph(sched, graph)
    check_graph(graph, fitted.graph)
    check(fitted)
    check_supported(fitted)
    return fitted


def _check_same_weights(model: nn.Module | Sequence[nn.Module]) -> None:
    """Every rank must start from the same weights: compare a fingerprint over the group."""
    root = model if isinstance(model, nn.Module) else nn.ModuleList(model)
    with torch.no_grad():
        mine = [float(p.double().sum()) for p in root.parameters()]
    every = comm.all_gather_object(mine)
    bad = [r for r, fp in enumerate(every) if fp != every[0]]
    if bad:
        raise ConfigError(f"rank {bad[0]} built other initial weights than rank 0; seed torch "
                          "(torch.manual_seed) before building the model on every rank")


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, threads: int = 1,
          timeout_s: float = 60.0, deadline_s: float = 600.0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes in one gloo group (the local launcher:
    ``flexpipe.pipeline`` inside ``fn`` finds the group); every rank's return value. ``fn``
    must be importable (defined at module level) and its result picklable."""
    return [r[0] for r in launch_task(_call, (fn, args), nprocs, threads=threads,
                                      timeout_s=timeout_s, deadline_s=deadline_s)]


def _call(rank: int, world: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    return [fn(*args)]
