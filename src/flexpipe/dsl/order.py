"""Explicit-order DSL: each rank's order is written as phases built from pass queues.

A ``Passes`` queue holds one rank's passes of one kind in the order they should run; combinators
consume from queues, so warm-up / steady / cool-down read like the papers' descriptions::

    fs, bs = prog.queue(r, "F"), prog.queue(r, "BW")
    prog.order(r, fs.take(warm), alternate(fs, bs), bs)      # 1F1B

Everything is a plain list of ``Op`` in the end; combinators only save typing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from flexpipe.ir.op import Op

Phase = Iterable[Op]


class Passes:
    """A consumable queue of ops. Iterating drains it; ``take(k)`` removes the first k."""

    def __init__(self, ops: Iterable[Op]) -> None:
        self._q: deque[Op] = deque(ops)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Op]:
        while self._q:
            yield self._q.popleft()

    def take(self, k: int) -> list[Op]:
        """Remove and return the first ``k`` ops (fewer when the queue is shorter)."""
        return [self._q.popleft() for _ in range(min(max(k, 0), len(self._q)))]

    def pop(self) -> Op:
        """Remove and return the first op."""
        return self._q.popleft()


def alternate(*queues: Passes, counts: Iterable[int] | None = None) -> list[Op]:
    """One op from each queue in turn (``counts`` ops from each when given), until the FIRST
    queue is empty: the steady phase of 1F1B is ``alternate(fs, bs)``."""
    per = list(counts) if counts is not None else [1] * len(queues)
    out: list[Op] = []
    while queues and queues[0]:
        for q, k in zip(queues, per, strict=True):
            out += q.take(k)
    return out


def interleave(*queues: Passes) -> list[Op]:
    """Round-robin over queues until all are empty."""
    out: list[Op] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop())
    return out


def after_each(first: Iterable[Op], then: Passes, lag: int = 0, on: str | None = None) -> list[Op]:
    """Each op of ``first`` (of kind ``on`` only, when given) followed by one op of ``then``,
    the first ``lag`` of them held back; the held-back ops close the phase. ZB-H1's deferred
    weight gradients: ``after_each(f_and_b, ws, lag=r, on="B")``."""
    out: list[Op] = []
    held = 0
    for op in first:
        out.append(op)
        if on is not None and op.kind != on:
            continue
        if held >= lag and then:
            out.append(then.pop())
        else:
            held += 1
    out += list(then)
    return out
