"""Overlapped pairs: two compute ops of one rank that run in one slot, as DualPipe runs a
forward of one micro-batch beside the backward of another so that each one's communication
(the experts' all-to-all, the pipeline's sends) hides behind the other's compute
(DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2.1). torch.distributed.pipelining
calls such a slot ``OVERLAP_F_B``.

A pair is ``(first, second)``: one forward ``F`` and one backward (``B``, ``BW`` or ``W``) of
other micro-batches or stages, listed one right after the other on their rank. Both start
together once both are ready and both end when the slot ends (``pair_time``). In the text
format a pair is written ``first&second`` (``2F5&5BW1``); in torch's CSV
``(2F5;5B1)OVERLAP_F_B``. Standard library only."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op

Pair = tuple[Op, Op]
FORWARD, BACKWARDS = "F", ("B", "BW", "W")
COMM_SHARE = "{}_COMM"
"""A stage's time key holding the communication part of a pass of kind {} (e.g. ``F_COMM``:
the all-to-all dispatch and combine inside F): the part an overlapped partner can hide."""


def check_pairs(ranks: Sequence[Sequence[Op]], pairs: Iterable[Pair]) -> None:
    """Every pair is one forward and one backward, not of the same stage and micro-batch,
    listed one right after the other on one rank; an op is in one pair at most. A
    ``ConfigError`` names the pair and what is wrong."""
    where = {op: (r, i) for r, ops in enumerate(ranks) for i, op in enumerate(ops)}
    seen: set[Op] = set()
    for a, b in pairs:
        name = f"overlapped pair {a}&{b}"
        if a not in where or b not in where:
            missing = a if a not in where else b
            raise ConfigError(f"{name}: {missing} is not in the schedule")
        (ra, ia), (rb, ib) = where[a], where[b]
        if ra != rb or ib != ia + 1:
            raise ConfigError(f"{name}: {b} must come right after {a} on its rank (found "
                              f"at rank {ra} position {ia} and rank {rb} position {ib})")
        kinds = sorted((a.kind, b.kind), key=lambda k: k != FORWARD)
        if kinds[0] != FORWARD or kinds[1] not in BACKWARDS:
            raise ConfigError(f"{name}: a pair is one forward (F) and one backward "
                              f"({', '.join(BACKWARDS)}), not {a.kind} and {b.kind}")
        if (a.stage, a.mb) == (b.stage, b.mb):
            raise ConfigError(f"{name}: the backward of a micro-batch needs its own forward "
                              "on that stage, so the two cannot run in one slot")
        for op in (a, b):
            if op in seen:
                raise ConfigError(f"{name}: {op} is already in another pair")
            seen.add(op)


def heads(pairs: Iterable[Pair]) -> dict[Op, Op]:
    """Each pair's first op -> its second."""
    return dict(pairs)


def slots(ops: Iterable[Op], pairs: dict[Op, Op]) -> Iterator[tuple[Op, ...]]:
    """A rank's ops slot by slot: ``(op,)``, or ``(first, second)`` for a pair (``heads``)."""
    seconds = set(pairs.values())
    for op in ops:
        if op not in seconds:
            yield (op, pairs[op]) if op in pairs else (op,)


HIDE_SHARE = "PAIR_HIDE"
"""A stage's key: the share of what a pair could hide that it does hide when the stage's pass
is its backward (default 1: all of it, the exchanges running beside the other pass's compute;
less where the runtime's two passes contend for the host, as two threads of one gloo process
on a busy CPU do; measured by ``flexpipe.runtime.measurement.passes.pair_hide``)."""


def pair_time(first: tuple[float, float], second: tuple[float, float],
              hide: float = 1.0) -> float:
    """The slot's time from each pass's (time, communication part): the compute of the two runs
    one after the other, and each pass's communication hides behind the other's compute, so
    the slot lasts the longer of the two computes summed and the two communications summed.
    Without communication parts it is the two times summed: nothing to hide. ``hide``: the
    share of that saving taken (``HIDE_SHARE``; 0: the two times summed)."""
    (ta, ca), (tb, cb) = first, second
    ideal = max(ta - ca + tb - cb, ca + cb)
    return ta + tb - hide * (ta + tb - ideal)


def comm_part(op: Op, total: float, time: Callable[[str], float],
              has: Callable[[str], bool]) -> float:
    """The communication part of ``op``'s ``total`` time, from its stage's ``COMM_SHARE`` key
    (0 without one); a part outside [0, total] is a ``ConfigError``."""
    key = COMM_SHARE.format(op.kind)
    comm = time(key) if has(key) else 0.0
    if not 0.0 <= comm <= total:
        raise ConfigError(f"stage {op.stage}: {key} = {comm} must be between 0 and its "
                          f"{op.kind} time {total}")
    return comm
