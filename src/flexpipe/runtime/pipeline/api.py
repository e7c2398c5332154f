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

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution import clipping
from flexpipe.runtime.execution.evaluate import EvalForward
from flexpipe.runtime.execution.failure import RankError
from flexpipe.runtime.execution.handlers import HANDLERS
from flexpipe.runtime.execution.parallel import Parallel
from flexpipe.runtime.execution.precision import MixedPrecision
from flexpipe.runtime.execution.stage import LossFn, StageModule
from flexpipe.runtime.execution.worker import RankWorker
from flexpipe.runtime.pipeline import items, state
from flexpipe.runtime.processes import dcp
from flexpipe.runtime.processes.launch import launch_task
from flexpipe.runtime.processes.train import param_groups
from flexpipe.runtime.transport import comm, experts, groups
from flexpipe.runtime.transport.engines import full
from flexpipe.runtime.user.interface import (
    Interface,
    as_inputs,
    check_inputs,
    gather,
    loss_for,
    order_inputs,
)
from flexpipe.schedules.dualpipe_twoway import data_microbatches


class Pipeline:
    """One rank's part of a pipelined model (made by ``pipeline``)."""

    def __init__(self, schedule: Schedule, stages: dict[int, StageModule],
                 loss_fn: LossFn | None, names: dict[int, str], *, rank: int, world: int,
                 seed: int | None, timeout_s: float, lookahead: int, owns_group: bool,
                 interface: Interface | None = None,
                 buffers: state.BufferNames | None = None,
                 parallel: Parallel | None = None,
                 loss_items: items.ItemCount | None = None,
                 mixed_precision: MixedPrecision | None = None,
                 groups_before: Sequence[object] = ()) -> None:
        self.schedule, self.rank, self.world = schedule, rank, world
        self.timeout_s = timeout_s
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
                                 seed=seed, parallel=parallel,
                                 mixed_precision=mixed_precision)
        self.pipe_rank, self.replica, self.dp, self.tp = \
            self.worker.pipe_rank, self.worker.replica, self.worker.dp, self.worker.tp
        self.tp_rank = self.worker.grid.coords["tp"]
        """This rank's index among the tensor-parallel ranks of its pipeline rank."""
        self.ep, self.ep_rank = self.worker.ep, self.worker.grid.coords["ep"]
        """Expert-parallel ranks and this rank's index among them; ``replica`` counts them
        (``dp`` is the number of data replicas: the mesh's dp x ep)."""
        self.device, self.stages = self.worker.device, self.worker.stages
        self.owns_group, self.model_names = owns_group, set(names.values())
        self.buffer_names = buffers or state.BufferNames()
        """Your model's buffers: id -> name, and which are persistent (in ``state_dict``)."""
        graph = schedule.graph
        self.first = [s for s in graph.sources() if s in self.stages]
        self.last = [s for s in graph.sinks() if s in self.stages]
        self.broken: str | None = None
        """Why a step or eval failed part-way (``_failing``); later calls are refused."""
        self.closed = False
        """Whether ``close`` ended this pipeline's groups (later calls are refused)."""
        self._collect = EvalForward()
        forward = schedule.with_ranks([[o for o in ops if o.kind == "F"]
                                       for ops in schedule.ranks])
        self.evaluator = self.worker.executor_for(forward, {**HANDLERS, "F": self._collect})
        self.groups = groups.made_since(groups_before)
        """The process groups ``pipeline`` created for this pipeline (``close`` ends them)."""

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
        shards, group = self.worker.experts, self.worker.grid.group("ep")
        return {name: experts.full(full(p), shards, group).detach().clone()
                for name, p in self.named_parameters()}

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
        self._refuse_experts("save")
        dcp.save(self.state_dict(), path, optimizer, self._param_names())

    def load(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Resume from the checkpoint ``path`` written by ``save`` (at this or another number
        of ranks and stages): this rank's parameters and buffers in place, and ``optimizer``'s
        state (built on ``parameters()``). Every rank calls it together."""
        self._refuse_experts("load")
        dcp.load(self.state_dict(), path, optimizer, self._param_names())

    def _refuse_experts(self, what: str) -> None:
        """Experts of the ``list`` style are saved under their own names, each by the rank
        that holds it; ``stacked`` ones (each rank's rows of one tensor) are refused."""
        stacked = sorted({sh.name for sh in self.worker.experts if sh.stacked})
        if comm.complaints(f"stacked experts {stacked}" if stacked else None):
            raise ConfigError(f"Pipeline.{what}: checkpoints of 'stacked' expert-parallel "
                              "modules (each ep rank's rows of one tensor) are not supported "
                              "yet; 'list' experts are")

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.named_parameters()}

    def step(self, inputs: Any = None, targets: torch.Tensor | None = None,
             **named: torch.Tensor) -> torch.Tensor | None:
        """Train on one batch: forward and backward of its m micro-batches (DualPipe: 2m, the
        way down on the first m, the way up on the others) in the schedule's order; gradients
        accumulate into ``.grad`` (averaged over data-parallel replicas). ``inputs`` (a tensor
        or tuple, batch first) or keyword inputs (``input_ids=..., attention_mask=...,
        labels=...``) only where ``needs_inputs``, ``targets`` only where ``needs_targets``.
        The batch's mean loss where it is computed, else None. Every rank checks its call and
        they agree first: a bad call on any rank raises on all."""
        batch = self._agreed("step", inputs, named, targets, training=True)
        for m in self.stages.values():
            m.train()
        scale, share = None, None
        if self.loss_items is not None:  # every rank: the counts go to the loss's rank
            counts = items.shared(self.counts, self.schedule.microbatches,
                                  self.worker.grid.group("pp"), self.device)
            scale, share = items.weights(counts, self.dp, self.worker.group, self.device)
        with self._failing("step"):
            out = self.worker.run(batch, weights=scale, call="Pipeline.step")
            self.worker.reduce_gradients()
        if out.loss is None:
            return None
        loss = torch.tensor(out.loss if share is None else items.replica_mean(
            out.loss, self.dp, share), dtype=torch.float64)
        if self.worker.twins is not None:  # DualPipe: each last stage holds one direction's
            self.worker.twins.add([loss])  # the pair of last stages (ranks 0, p-1) together
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the whole model's gradients, as ``torch.nn.utils.clip_grad_norm_`` clips one
        process's: the norm over every rank's parameters (a tied weight counted once; FSDP2 and
        tensor-parallel shards over their mesh), every gradient scaled by the same factor.
        Call it on every rank after ``step``; returns the total norm (float64), the same on
        every rank (``flexpipe.runtime.execution.clipping``)."""
        return clipping.clip_worker(self.worker, max_norm, norm_type, error_if_nonfinite)

    def eval(self, inputs: Any = None, **named: torch.Tensor) -> Any:
        """Forward only (no autograd, modules in eval mode): the model's outputs for the batch
        (micro-batches concatenated, in the model's own structure: a tensor, a tuple, a dict or
        a ``ModelOutput``) on the rank holding the last stage, else None."""
        if self.worker.twins is not None:
            raise ConfigError(f"{self.schedule.name}: Pipeline.eval does not run DualPipe's "
                              "two-way placement yet (each direction's outputs end on another "
                              "rank); evaluate under dualpipev, or on one process")
        batch = self._agreed("eval", inputs, named, None, training=False)
        for m in self.stages.values():
            m.eval()
        self._collect.outputs.clear()
        try:
            with self._failing("eval"):
                return self.worker.attempt(self.evaluator, lambda: self._evaluate(batch),
                                           "Pipeline.eval")
        finally:
            for m in self.stages.values():
                m.train()

    def _evaluate(self, batch: list[Any]) -> Any:
        """This rank's part of ``eval``: the forward step, then the outputs where they are."""
        self.evaluator.step(batch)
        if not self.last:
            return None
        parts = [self._collect.outputs[j] for j in range(self.schedule.microbatches)]
        return gather(parts, self.interface)

    def close(self) -> None:
        """End the process groups this pipeline made (every rank calls it together), and
        leave the process group if ``pipeline`` joined it (under torchrun)."""
        late = self.worker.clip_experts_group  # made on the first clip
        groups.drop_groups(([late] if late is not None else []) + self.groups, self.timeout_s)
        self.groups = []
        self.worker.clip_experts_group = None
        self.closed = True
        if self.owns_group:
            groups.shutdown()

    @contextlib.contextmanager
    def _failing(self, call: str) -> Iterator[None]:
        """Within: a failure every rank agreed on and recovered from (``RankError``: the
        transfers were reset) or a ConfigError raised after the ranks agreed refuses nothing;
        any other (a peer lost or stuck, FSDP or tensor-parallel collectives left unmatched)
        leaves transfers with the other ranks unmatched, so this pipeline refuses every later
        call at once, saying why, instead of pairing with them wrongly or waiting out a
        timeout."""
        try:
            yield
        except ConfigError:
            raise
        except RankError as exc:
            if not exc.recovered:
                self.broken = str(exc)
            raise
        except BaseException as exc:
            self.broken = (f"Pipeline.{call} failed on rank {self.rank} "
                           f"({type(exc).__name__}: {str(exc).strip()[:300]})")
            raise

    def _agreed(self, call: str, inputs: Any, named: dict[str, torch.Tensor], targets: Any,
                training: bool) -> list[Any]:
        """The batch of this call after every rank has checked its own and they agreed, before
        any message: a bad call on one rank raises the same ConfigError on all (naming each
        rank and its reason), so no rank pairs with another's next step."""
        if self.closed:
            raise RunError(f"Pipeline.{call}: this pipeline was closed (Pipeline.close ended "
                           "its process groups); build a new one with flexpipe.pipeline")
        if self.broken is not None:
            raise RunError(f"this pipeline cannot run Pipeline.{call}: {self.broken}, and its "
                           "transfers with the other ranks were left unmatched; restart the "
                           "processes and resume from your last checkpoint (Pipeline.load)")
        try:
            batch, mine = self._batch(self._inputs(inputs, named), targets, training,
                                      named.get("labels")), None
        except ConfigError as exc:
            batch, mine = [], str(exc)
        dcp.agree(mine, f"Pipeline.{call}")
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
        m = data_microbatches(self.schedule)  # DualPipe: m each way
        _no_autocast(self.device)
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
        return items.counts(self.loss_items, _chunks(labels, data_microbatches(self.schedule),
                                                     "labels"))


def _no_autocast(device: torch.device) -> None:
    """Refuse a call made under ``torch.autocast`` (the stages were traced without it: an
    exported graph's operations would then mix dtypes)."""
    on = [d for d in dict.fromkeys(("cpu", device.type)) if torch.is_autocast_enabled(d)]
    if on:
        raise ConfigError(
            f"called under torch.autocast ({on[0]}, {torch.get_autocast_dtype(on[0])}): the "
            "stages were traced without it; put the torch.autocast inside the model's forward "
            "(FlexPipe keeps that region in its stages), not around the pipeline's calls")


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


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, threads: int = 1,
          timeout_s: float = 60.0, deadline_s: float = 600.0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes in one gloo group (the local launcher:
    ``flexpipe.pipeline`` inside ``fn`` finds the group); every rank's return value. ``fn``
    must be importable (defined at module level) and its result picklable."""
    return [r[0] for r in launch_task(_call, (fn, args), nprocs, threads=threads,
                                      timeout_s=timeout_s, deadline_s=deadline_s)]


def _call(rank: int, world: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    return [fn(*args)]
