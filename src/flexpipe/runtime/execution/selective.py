"""Selective recompute (the DSL's SR kind): a model marks the part of a layer whose saved
activations are cheap to redo and large to keep (the attention core of a transformer) by
computing it through a ``Core`` module. In a forward marked for SR, every ``Core`` keeps only its
inputs: the tensors autograd would save inside it are dropped (placeholders) and SR recomputes
them from those inputs before the backward, filling the placeholders in order. A backward that
reaches a dropped tensor before SR fails with a message saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from flexpipe.errors import RunError


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class Core(nn.Module):
    """A parameter-free function whose saved activations SR drops and recomputes."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn
        self.session: Selective | None = None

    def forward(self, *args: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``fn(*args)``; inside an SR forward, with its saved tensors dropped."""
        if self.session is None or not torch.is_grad_enabled():
            return self.fn(*args)
        return self.session.run(self.fn, args)


@dataclass
class _Slot:
    """One saved tensor: empty until SR recomputes it."""

    value: torch.Tensor | None = None


@dataclass
class _Call:
    fn: Callable[..., torch.Tensor]
    args: tuple[torch.Tensor, ...]
    slots: list[_Slot] = field(default_factory=list)


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

    def run(self, fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]
            ) -> torch.Tensor:
        """Run one core with its saved tensors replaced by placeholders."""
        call = _Call(fn, args)
        self.calls.append(call)

        def pack(t: torch.Tensor) -> _Slot:
            call.slots.append(_Slot())
            return call.slots[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            return fn(*args)

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.value is None:
            raise RunError(f"{self.where}: the backward needs activations dropped for "
                              f"selective recompute, but no SR ran before it")
        return slot.value

    def recompute(self) -> None:
        """SR: redo every core from its inputs, filling the dropped tensors."""
        for call in self.calls:
            filled = iter(call.slots)

            def pack(t: torch.Tensor, filled: Iterator[_Slot] = filled) -> torch.Tensor:
                slot = next(filled, None)
                if slot is None:
                    raise RunError(f"{self.where}: SR recomputed more saved tensors than "
                                      f"the forward dropped (is the core deterministic?)")
                slot.value = t
                return t

            with torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(pack, _same):
                call.fn(*call.args)
            if next(filled, None) is not None:
                raise RunError(f"{self.where}: SR recomputed fewer saved tensors than the "
                                  f"forward dropped (is the core deterministic?)")
