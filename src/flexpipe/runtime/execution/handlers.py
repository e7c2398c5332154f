"""The handlers of the op kinds, and ``HANDLERS``: the one table from op kind name to handler.
Supporting a new kind (an FSDP gather, an optimizer step, ...) is one entry in that table (or in
a copy passed to ``Executor(handlers=...)``); a kind without one is reported by name.

Forward (F) keeps the stage's autograd graph, or only its inputs when the micro-batch is
recomputed (R). B computes the input gradients and frees the graph but for what W reads, W
the weight gradients left (``flexpipe.runtime.split``); BW does both at once.
OFFLOAD/RELOAD move the saved activations of a micro-batch to host memory and back (a no-op copy
on CPU).
SR recomputes the attention cores a forward marked for it dropped
(``flexpipe.runtime.execution.selective``). AG gathers a sharded stage's parameters over the
data-parallel group and RS reduce-scatters its gradient (``flexpipe.runtime.execution.fsdp``);
compute on a sharded stage that is not gathered fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.lower import lower
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.activations import ActivationMeter
from flexpipe.runtime.execution.executor import Executor, Handler, Slot, check_handlers
from flexpipe.runtime.execution.rng import Snapshot, drawing
from flexpipe.runtime.execution.selective import Selective
from flexpipe.runtime.execution.stage import Tensors
from flexpipe.runtime.split import WeightWork, notice, recorded_share, recording
from flexpipe.runtime.transport.engines import Sharded
from flexpipe.schedules.dualpipe_twoway import is_two_way


def _run_stage(ex: Executor, op: Op, inputs: Tensors) -> Tensors:
    """The stage forward; on a sink stage the scaled loss of the micro-batch."""
    ex.require_params(op)
    out = ex.stages[op.stage](*inputs)
    if op.stage not in ex.sinks:
        return out
    index = ex.sample(op)
    target = ex.batch[index][1]
    target = None if target is None else target.to(ex.device)  # None: the model's own loss
    weight = 1.0 / ex.data_count if ex.weights is None else ex.weights[index]
    floats = [o for o in out if o.is_floating_point()]
    if floats and (weight == 0.0 or ex.loss_error is not None):
        return (_zero_loss(floats),)  # nothing counted, or a loss refused: 0, no gradient
    try:
        loss = ex.loss_fn(*out, target)
        why = _not_a_loss(loss)
    except Exception as exc:  # noqa: BLE001 - the user's loss_fn: named, on every rank
        loss, why = None, f"raised {type(exc).__name__}: {exc}"
    if isinstance(loss, torch.Tensor) and why is None:
        return (loss * weight if ex.weights is not None else loss / ex.data_count,)
    gradients = "no gradient was added" if ex.loss_sum is None else \
        "the gradients hold the micro-batches before it: zero them before the next step"
    ex.loss_error = ex.loss_error or (
        f"the loss of stage {op.stage}, micro-batch {op.mb} {why}: loss_fn must return a "
        "scalar tensor (one number, e.g. a .mean()); the step ran to its end with that loss "
        f"and the later ones as 0 ({gradients})")
    return (_zero_loss(floats) if floats else torch.zeros((), device=ex.device),)


def _not_a_loss(loss: object) -> str | None:
    """Why ``loss`` cannot be a micro-batch's loss (None: it can)."""
    if not isinstance(loss, torch.Tensor):
        return f"is a {type(loss).__name__}, not a tensor"
    if loss.numel() != 1:
        return f"is a tensor of shape {tuple(loss.shape)}, not a scalar"
    if not loss.is_floating_point():
        return f"is a tensor of {loss.dtype}, not of a floating-point type"
    return None


def _zero_loss(floats: Sequence[torch.Tensor]) -> torch.Tensor:
    """A loss of 0 on the outputs' graph (its gradients 0; an empty mean's NaN dropped)."""
    return torch.stack([(o.nan_to_num(0.0, 0.0, 0.0) * 0).sum() for o in floats]).sum()


def forward(ex: Executor, op: Op) -> None:
    """F: run the stage on its inputs; hand the outputs over. A micro-batch that will be split
    records its products' weight work (``split``); one that will be recomputed keeps only its
    inputs (and, without a seed, the generator state it drew from)."""
    slot = ex.slot(op)
    slot.inputs, slot.sizes = ex.take_inputs(op)
    key = (op.stage, op.mb)
    if key in ex.marked["B"]:
        slot.work = WeightWork()
    if key in ex.marked["R"]:
        slot.rng = Snapshot.take(ex.device) if ex.seed is None else None
        with torch.no_grad(), drawing(ex.draw(op)):
            out = _run_stage(ex, op, slot.inputs)
    else:
        with _stashed(ex, op), _dropping(ex, op), _graph(ex, op, slot):
            out = slot.outputs = _run_stage(ex, op, slot.inputs)  # kept for B: counted
    if op.stage in ex.sinks:
        ex.add_loss(out[0])
    ex.hand_forward(op, out)


@contextlib.contextmanager
def _graph(ex: Executor, op: Op, slot: Slot) -> Iterator[None]:
    """A forward that builds the graph: products report to the slot's work (``split``), random
    numbers come from the run's seed, saved tensors are counted when memory is measured."""
    meter = ex.meter if (op.stage, op.mb) not in ex.marked["OFFLOAD"] else None
    if meter is not None and op.stage in ex.shards:
        meter.exclude(ex.params(op.stage))  # FSDP2's gathered parameters are not activations
    with recording(slot.work), drawing(ex.draw(op)), \
            (meter.saving() if meter else contextlib.nullcontext()):
        yield
    if slot.work is not None and op.stage not in ex.split_shares:
        _note_split(ex, op.stage, slot.work)
    if ex.meter is not None:
        ex.meter.record(*slot.outputs, *(slot.work.kept if slot.work is not None else ()))


def _note_split(ex: Executor, stage: int, work: WeightWork) -> None:
    """A stage's first split forward: its deferred share, and a notice naming the modules
    whose weights stay in B (``split.notice``)."""
    ex.split_shares[stage] = recorded_share(ex.stages[stage], work)
    if ex.split_shares[stage] < 1.0:
        notice(stage, ex.stages[stage], work)


def recompute(ex: Executor, op: Op) -> None:
    """R: rebuild the stage's graph from the saved inputs, drawing the same random numbers as
    the forward did (same seeds, or the generator state saved at F)."""
    slot = ex.slot(op)
    replay = slot.rng.replay() if slot.rng is not None else contextlib.nullcontext()
    with replay, _graph(ex, op, slot):
        slot.outputs = _run_stage(ex, op, slot.inputs)
    slot.rng = None


def backward_in(ex: Executor, op: Op) -> None:
    """B: input gradients; the weight layers keep only what W reads (their input and output
    gradient), everything else of the graph is freed."""
    ex.require_params(op)
    slot = ex.slot(op)
    work = slot.work if slot.work is not None else WeightWork()
    with work.backward_input():
        in_grads = _backward(ex, op, slot)
    slot.work = work
    if ex.meter is not None:
        ex.meter.record(*work.held)
    slot.stash = slot.selective = None
    _after_backward(ex, op, in_grads)


def backward_w(ex: Executor, op: Op) -> None:
    """W: the weight gradients B left."""
    ex.require_params(op)
    slot = ex.slot(op)
    if slot.work is not None:
        slot.work.run()
    slot.work = None
    _drop_if_done(ex, op)


def backward_full(ex: Executor, op: Op) -> None:
    """BW: input and weight gradients in one backward."""
    ex.require_params(op)
    slot = ex.slot(op)
    in_grads = _backward(ex, op, slot)
    slot.work = None
    _after_backward(ex, op, in_grads)
    slot.stash = slot.selective = None
    _drop_if_done(ex, op)


def _backward(ex: Executor, op: Op, slot: Slot) -> tuple[torch.Tensor | None, ...]:
    """One backward of the stage from its outputs (freeing the graph); its input gradients."""
    grads = ex.take_grads(op, slot.outputs)
    outs = [t for t in slot.outputs if t.requires_grad]
    gs = [g if g is not None else torch.ones_like(t)
          for t, g in zip(slot.outputs, grads, strict=True) if t.requires_grad]
    need: list[torch.Tensor] = [x for x in slot.inputs if x.requires_grad]
    if outs:
        torch.autograd.backward(outs, gs, inputs=need + ex.params(op.stage))
    return tuple(x.grad if x.requires_grad else None for x in slot.inputs)


def _after_backward(ex: Executor, op: Op, in_grads: tuple[torch.Tensor | None, ...]) -> None:
    slot = ex.slot(op)
    if slot.sizes:
        ex.hand_backward(op, slot.inputs, in_grads, slot.sizes)
    slot.inputs, slot.outputs = (), ()


def _drop_if_done(ex: Executor, op: Op) -> None:
    slot = ex.slots.get((op.stage, op.mb))
    if slot is not None and not (slot.to_send or slot.work or slot.outputs or slot.inputs):
        del ex.slots[(op.stage, op.mb)]


def send_f(ex: Executor, op: Op) -> None:
    """SEND_F: start sending the stage output to each remote consumer."""
    _send(ex, op)


def send_b(ex: Executor, op: Op) -> None:
    """SEND_B: start sending the input gradients to each remote producer."""
    _send(ex, op)


def _send(ex: Executor, op: Op) -> None:
    slot = ex.slot(op)
    for msg, peer in ex.messages(op):  # in the order the rank pair agrees on
        ex.p2p.send(slot.to_send.pop(msg.dst), msg, peer)
    ex.p2p.reap()
    _drop_if_done(ex, op)


def recv_f(ex: Executor, op: Op) -> None:
    """RECV_F: post the receive of the stage inputs from each remote producer."""
    box = ex.inbox.box("RECV_F", op.stage, op.mb)
    for msg, peer in ex.messages(op):  # in the order the rank pair agrees on
        box[msg.src] = ex.p2p.recv(msg, peer)


def recv_b(ex: Executor, op: Op) -> None:
    """RECV_B: post the receive of the output gradients from each remote consumer."""
    box = ex.inbox.box("RECV_B", op.stage, op.mb)
    for msg, peer in ex.messages(op):
        box[msg.src] = ex.p2p.recv(msg, peer)


class Stash:
    """Saved activations of one micro-batch, kept where ``move`` put them."""

    def __init__(self, params: Sequence[torch.Tensor], meter: ActivationMeter | None = None
                 ) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.items: list[torch.Tensor] = []
        self.meter = meter

    def pack(self, t: torch.Tensor) -> object:
        """Keep ``t`` (parameters stay where they are)."""
        if t.untyped_storage().data_ptr() in self.params:
            return ("param", t)
        if self.meter is not None:
            self.meter.record(t)
        self.items.append(t)
        return len(self.items) - 1

    def unpack(self, key: object) -> torch.Tensor:
        """Give a saved tensor back."""
        if isinstance(key, tuple):
            return key[1]  # type: ignore[no-any-return]
        return self.items[key]  # type: ignore[call-overload]

    def move(self, device: torch.device) -> None:
        """Copy the saved activations to ``device``."""
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.items = [t.to(device, non_blocking=True).pin_memory() if pin else t.to(device)
                      for t in self.items]
        if self.meter is not None and device.type != "cpu":  # reloaded to the device
            self.meter.record(*self.items)


@contextlib.contextmanager
def _stashed(ex: Executor, op: Op) -> Iterator[None]:
    """Run F with its saved tensors in a ``Stash`` when the micro-batch is offloaded."""
    if (op.stage, op.mb) not in ex.marked["OFFLOAD"]:
        yield
        return
    stash = Stash(ex.params(op.stage), ex.meter)
    ex.slot(op).stash = stash
    with torch.autograd.graph.saved_tensors_hooks(stash.pack, stash.unpack):
        yield


def offload(ex: Executor, op: Op) -> None:
    """OFFLOAD: move the micro-batch's saved activations to host memory."""
    stash = ex.slot(op).stash
    if isinstance(stash, Stash):
        stash.move(torch.device("cpu"))


def reload(ex: Executor, op: Op) -> None:
    """RELOAD: bring them back to the device before the backward."""
    stash = ex.slot(op).stash
    if isinstance(stash, Stash):
        stash.move(ex.device)


@contextlib.contextmanager
def _dropping(ex: Executor, op: Op) -> Iterator[None]:
    """Run F with its cores' saved tensors dropped when SR will redo them."""
    if (op.stage, op.mb) not in ex.marked["SR"]:
        yield
        return
    record = Selective(f"rank {ex.rank}: {op}")
    ex.slot(op).selective = record
    with record.active(ex.stages[op.stage]):
        yield
    if ex.meter is not None:  # what the cores keep for SR: their inputs, what a policy saved
        ex.meter.record(*record.kept())


def selective_recompute(ex: Executor, op: Op) -> None:
    """SR: recompute the activations the forward's cores (attention cores, selected regions)
    dropped, from their saved inputs; counted again when memory is measured."""
    record = ex.slot(op).selective
    if isinstance(record, Selective):
        filled = record.recompute()
        if ex.meter is not None:
            ex.meter.record(*filled)


def all_gather(ex: Executor, op: Op) -> None:
    """AG: gather the stage's full parameters from the data-parallel shards."""
    _shard(ex, op).gather()


def reduce_scatter(ex: Executor, op: Op) -> None:
    """RS: average the stage's gradient into this rank's shard; free the full parameters
    after the last open gather."""
    _shard(ex, op).reduce_scatter()


def _shard(ex: Executor, op: Op) -> Sharded:
    shard = ex.shards.get(op.stage)
    if shard is None:
        raise ConfigError(f"rank {ex.rank}: {op} needs stage {op.stage}'s parameters sharded "
                          f"over the data-parallel group (Executor(shards=...))")
    return shard


HANDLERS: Mapping[str, Handler] = MappingProxyType({
    "F": forward,
    "B": backward_in,
    "W": backward_w,
    "BW": backward_full,
    "R": recompute,
    "SEND_F": send_f,
    "RECV_F": recv_f,
    "SEND_B": send_b,
    "RECV_B": recv_b,
    "OFFLOAD": offload,
    "RELOAD": reload,
    "SR": selective_recompute,
    "AG": all_gather,
    "RS": reduce_scatter,
})


def check_supported(schedule: Schedule, handlers: Mapping[str, Handler] = HANDLERS) -> None:
    """Raise ``ConfigError`` naming every op kind of ``schedule`` that ``handlers`` (the
    standard table by default) cannot run, or what the runtime does not run with DualPipe's
    two-way placement (FSDP's gathers)."""
    gathers = sorted({op.kind for ops in schedule.ranks for op in ops} & {"AG", "RS"})
    if is_two_way(schedule) and gathers:
        raise ConfigError(f"{schedule.name}: the runtime does not run DualPipe's two-way "
                          f"placement with FSDP ({'/'.join(gathers)} ops) yet; run it without "
                          "--fsdp, or dualpipev")
    for rank, ops in enumerate(lower(schedule).ranks):
        check_handlers(ops, handlers, rank)
