"""The experts' all-to-all exchanges (``transport.experts``), differentiable and timed: the
seconds every pass spends inside them (a forward's counts exchange and its two exchanges of
tokens; a backward's two reverse exchanges, run by autograd on the thread of that backward) are
added to the *meter* of the op running it (``metering``). So the executor reports each pass's
communication part, a cost file's ``F_COMM`` / ``B_COMM`` / ``BW_COMM``
(``flexpipe.ir.overlap``), measured on the real ranks: a pass's time inside an exchange is the
transfer and the wait for the other ``ep`` ranks to reach it."""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Meter:
    """The seconds one op spent inside the experts' all-to-alls."""

    seconds: float = 0.0


_METER: contextvars.ContextVar[Meter | None] = contextvars.ContextVar(
    "flexpipe_exchange_meter", default=None)


@contextlib.contextmanager
def metering(meter: Meter) -> Iterator[Meter]:
    """Add the exchanges run inside (on this thread or context) to ``meter``."""
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


def _all_to_all(out: torch.Tensor, x: torch.Tensor, out_split: list[int] | None,
                in_split: list[int] | None, group: Any) -> torch.Tensor:
    """``dist.all_to_all_single`` into ``out``, its seconds added to the current meter."""
    start = time.perf_counter()
    dist.all_to_all_single(out, x, out_split, in_split, group=group)
    meter = _METER.get()
    if meter is not None:
        meter.seconds += time.perf_counter() - start
    return out


def counts(got: torch.Tensor, sent: torch.Tensor, group: Any) -> None:
    """Exchange the per-expert counts (``got[src * L + j]``: rank src's pairs for expert j)."""
    _all_to_all(got, sent, None, None, group)


class _Exchange(torch.autograd.Function):
    """The rows of ``x`` sent by ``in_split`` and received by ``out_split``; its backward is
    the reverse exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_split: list[int], in_split: list[int],
                group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_split, in_split), group
        out = x.new_empty((sum(out_split), *x.shape[1:]))
        return _all_to_all(out, x, out_split, in_split, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_split, in_split = ctx.splits
        grad = grad.contiguous()
        back = grad.new_empty((sum(in_split), *grad.shape[1:]))
        return _all_to_all(back, grad, in_split, out_split, ctx.group), None, None, None


def exchange(x: torch.Tensor, out_split: list[int], in_split: list[int],
             group: Any) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``x`` (``in_split`` rows to each rank, in rank
    order; ``out_split`` from each), differentiable: its backward is the reverse exchange."""
    out: torch.Tensor = _Exchange.apply(x.contiguous(), out_split, in_split, group)
    return out
