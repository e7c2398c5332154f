"""The executor: runs one rank's ops of a (lowered) schedule, in order, by looking each op's kind
up in ONE dispatch table (kind name -> handler) given to it: the standard one is
``flexpipe.runtime.execution.handlers.HANDLERS``, which sits above this module.

It owns the per-micro-batch state of its stages (``Slot``) and the inboxes through which stages
hand tensors to each other (``flexpipe.runtime.execution.inbox``): a local consumer's inbox gets
the tensors directly, a remote one through ``SEND_*``/``RECV_*`` ops; receives are posted in
each sender's order (``flexpipe.ir.pairs``; a message only one side posts, or a transport that
would deadlock, is refused with ``PairOrderError`` before the first step). Receives are posted up to
``lookahead`` ops early (posting never waits; only the op that uses the tensors does), so
transfers overlap compute. An overlapped pair's two passes run at once, the forward on a
worker thread, each on its own expert lane (``flexpipe.runtime.execution.overlap``).
Every op's start and end are recorded for a measured ``Trace``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from flexpipe.errors import ConfigError, PairOrderError, RunError
from flexpipe.ir.consumed import proofs
from flexpipe.ir.lower import lower
from flexpipe.ir.op import Op
from flexpipe.ir.pairs import Message, transfers
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.activations import ActivationMeter
from flexpipe.runtime.execution.collector import collector_paused
from flexpipe.runtime.execution.fsdp import check_closed, param_bytes, uses_fsdp
from flexpipe.runtime.execution.inbox import Box, Inbox
from flexpipe.runtime.execution.overlap import PairRunner
from flexpipe.runtime.execution.rng import Draw, Snapshot
from flexpipe.runtime.execution.stage import Batch, LossFn, StageModule, Tensors
from flexpipe.runtime.execution.timing import Stamp, StepClock
from flexpipe.runtime.split import WeightWork
from flexpipe.runtime.transport.engines import Sharded
from flexpipe.runtime.transport.exchange import Meter, metering
from flexpipe.runtime.transport.experts import expert_lane
from flexpipe.runtime.transport.p2p import P2P, Incoming
from flexpipe.schedules.dualpipe_twoway import data_index, data_microbatches
from flexpipe.sim.pairs import pair_violations

Handler = Callable[["Executor", Op], None]


@dataclass
class Slot:
    """State of one stage and micro-batch between its ops."""

    inputs: Tensors = ()
    outputs: Tensors = ()
    sizes: list[tuple[int, int]] = field(default_factory=list)  # (producer stage, tensors)
    work: WeightWork | None = None  # weight-gradient work of a split micro-batch (B -> W)
    rng: Snapshot | None = None  # generator state of a forward to be recomputed (no seed)
    to_send: dict[int, Tensors] = field(default_factory=dict)  # neighbour stage -> tensors
    stash: object | None = None  # saved activations (offload)
    selective: object | None = None  # dropped attention-core activations (SR)


@dataclass
class StepResult:
    """One step on one rank: the summed micro-batch losses (sink stages only, else None) and
    every op's start and end in seconds from the step's start."""

    loss: float | None
    starts: list[float]
    ends: list[float]
    activations: list[float] = field(default_factory=list)
    """Live activation bytes after every op (only when the executor measures memory)."""
    param_bytes: list[float] = field(default_factory=list)
    """Parameter and gradient bytes after every op (only when the executor measures memory;
    under FSDP they rise at AG and fall at RS)."""
    comm: list[float] = field(default_factory=list)
    """Seconds every op spent inside the experts' all-to-alls (``transport.exchange``)."""


class Executor:
    """Runs ``rank``'s part of ``schedule`` (lowered here if it has no communication ops);
    ``concurrent_pairs`` False runs an overlapped pair's passes one after the other."""

    def __init__(self, schedule: Schedule, rank: int, stages: Mapping[int, StageModule],
                 loss_fn: LossFn, p2p: P2P, handlers: Mapping[str, Handler],
                 device: torch.device | None = None, lookahead: int = 2,
                 shards: Mapping[int, Sharded] | None = None, seed: int | None = None,
                 replica: int = 0, measure_memory: bool = False,
                 concurrent_pairs: bool = True) -> None:
        self.schedule = lower(schedule)
        self.rank = rank
        self.ops = self.schedule.ranks[rank]
        self.data_count = data_microbatches(self.schedule)
        """The micro-batches of data a step takes (2m for DualPipe's two directions)."""
        self.pairs = PairRunner(self.ops, self.schedule.overlaps, concurrent_pairs)
        """This rank's overlapped pairs and the lanes of every pass (``execution.overlap``)."""
        self.handlers = dict(handlers)
        check_handlers(self.ops, self.handlers, rank)
        self.stages: dict[int, StageModule] = dict(stages)
        self.loss_fn = loss_fn
        self.device = device or torch.device("cpu")
        self.clock = StepClock(self.device)
        graph = self.schedule.graph
        self.preds, self.succs = graph.preds, graph.succs
        self.sources, self.sinks = set(graph.sources()), set(graph.sinks())
        self.stage_rank = self.schedule.placement.stage_rank
        self.index = {op: i for i, op in enumerate(self.ops)}
        self.transfers = transfers(self.schedule)
        _check_transport(self.schedule)
        self.expected = {src: msgs for (src, dst), msgs in self.transfers.sent.items()
                         if dst == rank}
        """Per sending rank, the messages it sends this rank in a step, in its order."""
        self.relink(p2p)
        self.inbox = Inbox(self.ops, lookahead)
        self.marked = {k: {(o.stage, o.mb) for o in self.ops if o.kind == k}
                       for k in ("R", "OFFLOAD", "SR", "B")}
        self.seed, self.replica, self.steps_done = seed, replica, 0
        self.weights: tuple[float, ...] | None = None
        """This step's weight of each micro-batch's loss (None: 1 / m each; ``step``)."""
        self.memory_meter = ActivationMeter.of(self.stages.values()) \
            if measure_memory else None
        """Counts the live activations on a metered step (``step(metered=True)``)."""
        self.meter = self.memory_meter
        self.split_shares: dict[int, float] = {}
        """Per stage, the share of its trainable weights its split micro-batches leave to W
        (``split.recorded_share``, from the first one; a stage below 1 is noticed once)."""
        self.on_done: Callable[[int], None] | None = None
        """Called with an op's index after it ran (the gradient ``Reducer`` starts there)."""
        self.shards = dict(shards or {})
        if uses_fsdp(self.ops) and set(self.shards) != set(self.stages):
            raise ConfigError(f"rank {rank}: the schedule gathers parameters (AG) but stages "
                              f"{sorted(set(self.stages) - set(self.shards))} are not sharded")
        self.current: Op | None = None
        """The op this rank is running (or posting the receives of); None outside a step's
        ops (a failure then names the step's start or end)."""
        self._reset([])

    def relink(self, p2p: P2P) -> None:
        """Transfer with the other ranks through ``p2p`` from now on (at construction, and
        after a step abandoned part-way: every rank at the same point)."""
        self.p2p = p2p
        p2p.connect(self.transfers.channels())
        p2p.prove_by(proofs(self.schedule, self.transfers, self.rank))

    def _reset(self, batch: Batch, metered: bool = True) -> None:
        self.batch, self.current = batch, None
        self.meter = self.memory_meter if metered else None
        self.slots: dict[tuple[int, int], Slot] = {}
        self.inbox.reset()
        self.loss_sum: torch.Tensor | None = None
        self.loss_error: str | None = None
        """Why a micro-batch's loss was refused this step (handlers: later ones count 0)."""
        self.starts: list[Stamp] = [0.0] * len(self.ops)
        self.ends: list[Stamp] = [0.0] * len(self.ops)
        self.comm: list[float] = [0.0] * len(self.ops)
        self.live: list[float] = []
        self.param_live: list[float] = []
        if self.meter is not None:
            self.meter.peak = 0.0
            self.meter.data(t for inputs, target in batch for t in (*inputs, target)
                            if isinstance(t, torch.Tensor))  # the batch: not activations
        self.clock.start()

    # --- the loop ---------------------------------------------------------------------------
    def step(self, batch: Batch, metered: bool = True,
             weights: Sequence[float] | None = None) -> StepResult:
        """Run every op of this rank once for ``batch`` (one (inputs, target) per micro-batch);
        gradients accumulate into the stage parameters' ``.grad``. With ``metered`` (and a
        meter: ``measure_memory``) the live bytes are sampled after every op; a step timed
        for a prediction runs unmetered, since the meter's own work slows the ops. Each
        micro-batch's loss is divided by m (2m for DualPipe), or multiplied by its ``weights``
        entry (on the ranks that compute the loss: ``Pipeline``'s ``loss_items``)."""
        if len(batch) != self.data_count:
            raise ConfigError(f"the schedule takes {self.data_count} micro-batches, "
                              f"the batch has {len(batch)}")
        self.weights = None if weights is None else tuple(weights)
        with collector_paused():
            return self._step(batch, metered)

    def _step(self, batch: Batch, metered: bool) -> StepResult:
        self._reset(batch, metered)
        self.p2p.expect(self.expected)
        for i, op in enumerate(self.ops):
            self._prefetch(i)
            self.current = op
            if op in self.inbox.posted:
                self._sample()
                continue
            if i in self.pairs.seconds:  # ran with the pair's first op
                continue
            if i in self.pairs.heads:
                self._pair(i)
                continue
            self._await(op)
            self._timed(i)
            self._done(i)
        self.current = None
        self.p2p.flush()
        check_closed(self.shards, self.rank)
        self.steps_done += 1
        leftover = [k for k, s in self.slots.items() if (s.work and s.work.pending) or s.outputs]
        if leftover:
            raise RunError(f"rank {self.rank}: the schedule left stage/micro-batch "
                              f"{leftover[:4]} without its backward")
        loss = None if self.loss_sum is None else float(self.loss_sum)
        return StepResult(loss, self.clock.seconds(self.starts), self.clock.seconds(self.ends),
                          self.live, self.param_live, list(self.comm))

    def _timed(self, i: int) -> None:
        """Run op ``i`` on its expert lane, noting its start and end."""
        op = self.ops[i]
        meter = Meter()
        self.starts[i] = self.now()
        with expert_lane(self.pairs.lane_of(op)), metering(meter):
            self.handlers[op.kind](self, op)
        self.ends[i] = self.now()
        self.comm[i] = meter.seconds

    def _done(self, i: int) -> None:
        if self.on_done is not None:
            self.on_done(i)
        self._sample()

    def _pair(self, i: int) -> None:
        """The overlapped pair at positions i and i + 1: both gated receives first, then the
        two passes at once (``PairRunner.run``)."""
        self._prefetch(i + 1)
        for j in (i, i + 1):
            self._await(self.ops[j])
        self.pairs.run(i, self.ops, self._timed)
        for j in (i, i + 1):
            self._done(j)

    def _sample(self) -> None:
        """Note the live activation bytes after an op (when memory is measured)."""
        if self.meter is not None:
            self.live.append(self.meter.live())
            self.param_live.append(param_bytes(self.stages, self.shards))

    def draw(self, op: Op) -> Draw | None:
        """Where ``op``'s forward draws random numbers from (None: the global generator)."""
        if self.seed is None:
            return None
        return Draw(self.seed, self.steps_done, self.replica * self.data_count + self.sample(op))

    def sample(self, op: Op) -> int:
        """Which micro-batch of the step's batch ``op`` computes on (``op.mb``; on the way up
        of DualPipe, m + ``op.mb``: ``dualpipe_twoway.data_index``)."""
        return data_index(self.schedule, op.stage, op.mb)

    def now(self) -> Stamp:
        """A timestamp of this moment in the step (``StepClock``)."""
        return self.clock.stamp()

    def _await(self, op: Op) -> None:
        """Wait for the receives that gate ``op`` (per the kind registry's gates) before it
        starts, so its measured time is compute only."""
        for recv, box, stage in self.inbox.gating(op):
            box[stage] = self._resolve(box, stage, op, recv)

    def _prefetch(self, i: int) -> None:
        """Post the receives of the next ``lookahead`` ops now (posting does not wait)."""
        for j in self.inbox.to_post(i):
            self.starts[j] = self.ends[j] = self.now()
            self.current = self.ops[j]
            self.handlers[self.ops[j].kind](self, self.ops[j])

    # --- state helpers used by the handlers ---------------------------------------------------
    def messages(self, op: Op) -> tuple[tuple[Message, int], ...]:
        """(message, peer pipeline rank) of a send or receive op of this rank, in the order
        they are posted."""
        return self.transfers.posts.get((self.rank, self.index[op]), ())

    def slot(self, op: Op) -> Slot:
        """The state of ``op``'s stage and micro-batch."""
        return self.slots.setdefault((op.stage, op.mb), Slot())

    def require_params(self, op: Op) -> None:
        """Fail clearly when ``op`` would use a sharded stage whose parameters are not
        gathered (no AG before it in its run)."""
        shard = self.shards.get(op.stage)
        if shard is not None and not shard.gathered:
            raise RunError(f"rank {self.rank}: {op} runs on stage {op.stage}, whose "
                              f"parameters are sharded and not gathered (no AG before it)")

    def params(self, stage: int) -> list[torch.Tensor]:
        """The trainable parameters ``stage`` computes with now (under FSDP: the gathered
        ones while gathered)."""
        return [p for p in self.stages[stage].parameters() if p.requires_grad]

    def is_local(self, stage: int) -> bool:
        """Whether ``stage`` runs on this rank."""
        return self.stage_rank[stage] == self.rank

    def take_inputs(self, op: Op) -> tuple[Tensors, list[tuple[int, int]]]:
        """The stage inputs of ``op`` as leaves (``StageModule.leaves``: those whose gradient
        flows back require one; a source stage reads its batch inputs) and how many came from
        each producer."""
        if op.stage in self.sources:
            picked = self.stages[op.stage].pick_inputs(self.batch[self.sample(op)][0])
            return tuple(t.to(self.device) for t in picked), []
        box = self.inbox.take("RECV_F", op.stage, op.mb)
        parts, sizes = [], []
        for pred in self.preds[op.stage]:
            got = self._resolve(box, pred, op, "RECV_F")
            parts += list(got)
            sizes.append((pred, len(got)))
        return self.stages[op.stage].leaves([t.to(self.device) for t in parts]), sizes

    def take_grads(self, op: Op, outputs: Tensors) -> list[torch.Tensor | None]:
        """Gradients of ``outputs`` (None for a sink's loss and for non-float outputs), summed
        over the consumers."""
        total: list[torch.Tensor | None] = [None] * len(outputs)
        if op.stage in self.sinks:
            return total
        box = self.inbox.take("RECV_B", op.stage, op.mb)
        stage = self.stages[op.stage]
        for succ in self.succs[op.stage]:
            got = self._resolve(box, succ, op, "RECV_B")
            slots = stage.returned(succ, outputs)
            for i, g in zip(slots, (t.to(self.device) for t in got), strict=True):
                prev = total[i]
                total[i] = g if prev is None else prev + g
        return total

    def _resolve(self, box: Box, stage: int, op: Op, recv: str) -> Tensors:
        if stage not in box:
            raise RunError(f"rank {self.rank}: {op} needs tensors of stage {stage} for "
                              f"micro-batch {op.mb}, which never arrived (no {recv} before it?)")
        got = box[stage]
        if isinstance(got, Incoming):
            got = got.get()
            i = self.index.get(Op(recv, op.stage, op.mb))
            if i is not None:
                self.ends[i] = self.now()
        return got

    def hand_forward(self, op: Op, outputs: Tensors) -> None:
        """Give ``op``'s outputs to local consumers; keep them for a send to remote ones."""
        slot, stage = self.slot(op), self.stages[op.stage]
        for succ in self.succs[op.stage]:
            handed = tuple(t.detach() for t in stage.handed(succ, outputs))
            if self.is_local(succ):
                self.inbox.box("RECV_F", succ, op.mb)[op.stage] = handed
            else:
                slot.to_send[succ] = handed

    def hand_backward(self, op: Op, inputs: Tensors, grads: Sequence[torch.Tensor | None],
                      sizes: list[tuple[int, int]]) -> None:
        """Split the input gradients by producer (zeros where an input got none; only the
        inputs that require one carry a gradient back) and hand them over or keep them for the
        send."""
        slot, offset = self.slot(op), 0
        for pred, count in sizes:
            part = [torch.zeros_like(x) if g is None else g
                    for x, g in zip(inputs[offset:offset + count], grads[offset:offset + count],
                                    strict=True) if x.requires_grad]
            offset += count
            if self.is_local(pred):
                self.inbox.box("RECV_B", pred, op.mb)[op.stage] = tuple(part)
            else:
                slot.to_send[pred] = tuple(part)

    def add_loss(self, loss: torch.Tensor) -> None:
        """Count one micro-batch's (already scaled) loss (summed in float64: a float32 loss,
        as Hugging Face models compute it, adds up like one device's Python floats)."""
        val = loss.detach().double()
        self.loss_sum = val if self.loss_sum is None else self.loss_sum + val


def _check_transport(schedule: Schedule) -> None:
    """Refuse a lowered schedule whose rank pairs disagree on the order of their messages."""
    found = pair_violations(schedule)
    if found:
        raise PairOrderError(found)


def check_handlers(ops: tuple[Op, ...], handlers: Mapping[str, Handler], rank: int) -> None:
    """Every op kind of the schedule needs a handler: name the ones that have none."""
    missing = sorted({op.kind for op in ops} - set(handlers))
    if missing:
        raise ConfigError(
            f"rank {rank}: the runtime has no handler for op kind(s) {', '.join(missing)} "
            f"(handled: {', '.join(sorted(handlers))}); add one entry per kind to the "
            f"executor's handler table (flexpipe.runtime.execution.handlers.HANDLERS)")
