"""Selective recompute (the DSL's SR kind): a model marks the parts whose saved activations are
cheap to redo and large to keep by computing them through a ``Core`` module: the built-in GPT's
attention core, or any region a user selects in a traced model (``flexpipe.runtime.user.
recompute``: modules by type or name, every n-th one, a model's own checkpoints). In a forward
marked for SR, every ``Core`` keeps only its inputs: the tensors autograd would save inside it
are dropped (placeholders) and SR recomputes them from those inputs before the backward,
filling the placeholders in order; a core with a per-operation policy (``op_policy``) keeps
the outputs of the operations it saves, and the recompute takes those instead of computing
them again. The recompute draws the same random numbers as the forward
(the same keyed generators and training flag, the generator state the call started from) and
computes its products as the forward did (split for W or not), so it is exact. A backward that
reaches a dropped tensor before SR fails with a message saying so.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from flexpipe.errors import RunError
from flexpipe.runtime.execution.op_policy import OpPolicy, Replaying, Saving
from flexpipe.runtime.execution.rng import Snapshot
from flexpipe.runtime.split import WeightWork, current, recording


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class Core(nn.Module):
    """A function (parameter-free, or a module of the stage whose parameters it reads) whose
    saved activations SR drops and recomputes."""

    def __init__(self, fn: Callable[..., object], policy: OpPolicy | None = None) -> None:
        super().__init__()
        self.fn = fn
        self.policy = policy
        """Which operations' outputs SR keeps rather than recomputes (``op_policy``; None:
        none)."""
        self.session: Selective | None = None

    def forward(self, *args: object) -> object:  # type: ignore[override]
        """``fn(*args)``; inside an SR forward, with its saved tensors dropped."""
        if self.session is None or not torch.is_grad_enabled():
            return self.fn(*args)
        return self.session.run(self.fn, args, self.policy)


@dataclass
class _Slot:
    """One saved tensor: empty until SR recomputes it."""

    value: torch.Tensor | None = None


@dataclass
class _Call:
    fn: Callable[..., object]
    args: tuple[object, ...]
    context: contextvars.Context
    """The forward's context: keyed generators, training flag, weight-gradient recording."""
    rng: Snapshot
    split: WeightWork | None
    """The forward's weight-gradient work where its products were split for W (None: not
    recorded); the recompute splits them again as the forward did, taking the same tensors
    for activations (its ``known`` nodes)."""
    policy: OpPolicy | None = None
    saved: Saving | None = None
    """The outputs the policy kept in the forward (``op_policy``)."""
    slots: list[_Slot] = field(default_factory=list)


def _device(args: tuple[object, ...]) -> torch.device:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return first.device if first is not None else torch.device("cpu")


class Selective:
    """The ``Core`` calls of one stage and micro-batch: their inputs and dropped tensors."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls: list[_Call] = []

    @contextlib.contextmanager
    def active(self, module: nn.Module) -> Iterator[None]:
        """Within: every ``Core`` of ``module`` drops its saved tensors into this record."""
        cores = [m for m in module.modules() if isinstance(m, Core)]
        for core in cores:
            core.session = self
        try:
            yield
        finally:
            for core in cores:
                core.session = None

    def kept(self) -> list[torch.Tensor]:
        """The tensors the calls keep for SR: their inputs (and what a per-op policy saved)."""
        return [t for c in self.calls for t in (
            *(a for a in c.args if isinstance(a, torch.Tensor)),
            *(c.saved.tensors() if c.saved is not None else ()))]

    def run(self, fn: Callable[..., object], args: tuple[object, ...],
            policy: OpPolicy | None = None) -> object:
        """Run one core with its saved tensors replaced by placeholders (the outputs of the
        operations ``policy`` saves kept aside for SR's recompute)."""
        call = _Call(fn, args, contextvars.copy_context(), Snapshot.take(_device(args)),
                     current(), policy, Saving(policy) if policy else None)
        self.calls.append(call)

        def pack(t: torch.Tensor) -> _Slot:
            call.slots.append(_Slot())
            return call.slots[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack), \
                (call.saved or contextlib.nullcontext()):
            return fn(*args)

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.value is None:
            raise RunError(f"{self.where}: the backward needs activations dropped for "
                              f"selective recompute, but no SR ran before it")
        return slot.value

    def recompute(self) -> list[torch.Tensor]:
        """SR: redo every core from its inputs, filling the dropped tensors; the tensors it
        filled them with."""
        for call in self.calls:
            call.context.run(self._redo, call)
            call.args = ()  # its inputs are no longer held for it: a full forward's memory
        return [s.value for c in self.calls for s in c.slots if s.value is not None]

    def _redo(self, call: _Call) -> None:
        """One call again, in its forward's context (run inside ``call.context``)."""
        filled = iter(call.slots)

        def pack(t: torch.Tensor) -> torch.Tensor:
            slot = next(filled, None)
            if slot is None:
                raise RunError(f"{self.where}: SR recomputed more saved tensors than "
                                  f"the forward dropped (is the core deterministic?)")
            slot.value = t.detach()  # not the recompute's own graph: an op that saves its
            return slot.value  # output would keep it alive in a cycle (``ActivationMeter``)

        with torch.enable_grad(), call.rng.replay(), \
                recording(WeightWork(known=set(call.split.known))
                          if call.split is not None else None), \
                torch.autograd.graph.saved_tensors_hooks(pack, _same), \
                (Replaying(call.policy, call.saved.store, self.where)
                 if call.policy and call.saved else contextlib.nullcontext()):
            call.fn(*call.args)
        call.saved = None  # the slots hold what it kept now
        if next(filled, None) is not None:
            raise RunError(f"{self.where}: SR recomputed fewer saved tensors than the "
                              f"forward dropped (is the core deterministic?)")
