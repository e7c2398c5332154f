"""Activation memory as it really is: the bytes of the tensors a rank holds for its backward
passes, counted from the live tensors themselves (no allocator statistics needed, so it works on
the CPU as on a GPU).

An ``ActivationMeter`` records storages as they come to be held — every tensor autograd saves in
a forward (``saving()``), a stage's outputs kept for its backward, the (input, output gradient)
pairs B keeps for W — and ``live()`` sums the bytes of those still alive, each storage once
(views of one buffer count once; parameters never count). A storage is forgotten as soon as
nothing holds it, so the figure after an op is what that op left behind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from flexpipe.runtime.transport.engines import local


class ActivationMeter:
    """Live activation bytes of one rank (or one stage being profiled)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.params = {_ptr(p) for p in params}
        self.batch: set[int] = set()
        self.held: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0.0

    @classmethod
    def of(cls, modules: Iterable[torch.nn.Module]) -> ActivationMeter:
        """A meter for ``modules``' activations: their parameters and buffers (BatchNorm's
        running statistics, which its forward saves) are the model's, never counted."""
        mods = list(modules)
        return cls([t for m in mods for t in (*m.parameters(), *m.buffers())])

    def exclude(self, params: Iterable[torch.Tensor]) -> None:
        """Never count ``params`` either (parameters FSDP2 gathered after the meter was made)."""
        self.params.update(_ptr(p) for p in params)

    def data(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count ``tensors`` (a step's batch inputs, which the caller holds for the whole
        step whatever the schedule: data, not activations); replaces the previous batch."""
        self.batch = {_ptr(t) for t in tensors}

    def record(self, *tensors: torch.Tensor | None) -> None:
        """Count the storages of ``tensors`` while they live."""
        for t in tensors:
            if t is None or t.is_sparse:
                continue
            storage = local(t).untyped_storage()
            ptr = storage.data_ptr() if storage.nbytes() else 0
            if ptr and ptr not in self.params and ptr not in self.batch:
                self.held[ptr] = (StorageWeakRef(storage), storage.nbytes())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Record a tensor autograd saves, and save it detached: an op that saves its own
        output (``exp``) would otherwise hold the tensor whose ``grad_fn`` it is, a cycle no
        backward breaks where the output feeds nothing (an unrolled loop's last state), kept
        alive, and counted, until the step's end."""
        self.record(t)
        return t.detach()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Within: every tensor autograd saves for backward is recorded."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _same):
            yield

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is one of the held ones (as of the last ``live()``)."""
        return _ptr(t) in self.held

    def holder(self, ts: Sequence[torch.Tensor]) -> Callable[[], list[bool]]:
        """Whether each of ``ts`` is held (as of the last ``live()``), asked later without
        keeping them alive (a tensor kept alive would stay counted)."""
        keys = [_ptr(t) for t in ts]
        return lambda: [key in self.held for key in keys]

    def live(self) -> float:
        """Bytes of the recorded storages still alive (and the running peak updated)."""
        dead = [ptr for ptr, (ref, _) in self.held.items() if ref.expired()]
        for ptr in dead:
            del self.held[ptr]
        total = float(sum(size for _, size in self.held.values()))
        self.peak = max(self.peak, total)
        return total


def _ptr(t: torch.Tensor) -> int:
    """Where ``t``'s storage (a DTensor's: its local shard's) lives; 0 for a freed one."""
    storage = local(t).untyped_storage()
    return storage.data_ptr() if storage.nbytes() else 0


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
