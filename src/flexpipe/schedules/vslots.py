"""The controllable-memory paper's squeeze of a fixed V pattern, done on the slot table (written
from the paper's description and its authors' scheduler's behaviour; standard library only).

Time is cut into unit slots; every pass of ``vpattern.slot_table`` has one. The steady phase
(from the first backward of stage 0 to the last forward of stage 0) stays as the pattern lays
it out. Each pass of the warm-up and the cool-down, taken in slot order, moves to the earliest
free slot after its inputs' slots where its rank's count of chunk activations in flight (F +1,
W -1) stays within the pattern's own peak. The result is compacted (every pass as early as its
inputs and its rank's previous pass allow, in slot order), its W passes are dropped and the
cool-down is squeezed again with each W running in the first free slot after its B (oldest
first), and the W passes are laid out that way. The ranks then run their passes in slot order:
real pass times and transfers only stretch the timeline.

At unit times this reaches the authors' bubble: V-Half 0.0649 / 0.0924 / 0.1056 / 0.1246 at
p = 4 / 6 / 8 / 16 and V-Min 0.1360 at p = 6 (m = 3p).
"""

from __future__ import annotations

import heapq
from collections import deque

from flexpipe.ir.op import Op

Slots = dict[Op, int]
UNIT_MEM = {"F": 1, "B": 0, "W": -1}


def squeeze_slots(slots: Slots, p: int, m: int, limit: int | None = None) -> Slots:
    """The pattern ``slots`` (F and B passes of the V placement, W optional) squeezed as the
    module docstring says; returns every pass's slot, W included. ``limit`` (chunk passes in
    flight per rank) lets warm-up and cool-down use more memory than the pattern's peak (never
    less: the steady phase keeps the pattern's)."""
    base = {op: t for op, t in slots.items() if op.kind != "W"}
    first = _move(_with_w(base, p), p, m, warm_up=True, limit=limit)
    compact = _compact(first, p)
    second = _move({op: t for op, t in compact.items() if op.kind != "W"}, p, m,
                   warm_up=False, limit=limit)
    return _with_w(second, p)


def _rank(op: Op, p: int) -> int:
    return op.stage if op.stage < p else 2 * p - 1 - op.stage


def _type(op: Op, p: int) -> int:
    """Tie order within a slot: F down, F up, B up, B down, W."""
    up = op.stage >= p
    return {"F": 1 if up else 0, "B": 2 if up else 3, "W": 4}[op.kind]


def _inputs(op: Op, p: int) -> list[Op]:
    """The passes ``op`` waits for, and its predecessor of the same kind and stage."""
    s, j = op.stage, op.mb
    out = [Op(op.kind, s, j - 1)] if j > 0 else []
    if op.kind == "F" and s > 0:
        out.append(Op("F", s - 1, j))
    elif op.kind == "B":
        out.append(Op("B", s + 1, j) if s < 2 * p - 1 else Op("F", s, j))
    elif op.kind == "W":
        out.append(Op("B", s, j))
    return out


def _with_w(slots: Slots, p: int) -> Slots:
    """``slots`` (no W) with each W in the first free slot of its rank after its B, oldest B
    first."""
    out = dict(slots)
    rows: dict[int, dict[int, Op]] = {}
    for op, t in slots.items():
        rows.setdefault(_rank(op, p), {})[t] = op
    for row in rows.values():
        out.update(fill_w(row))
    return out


def fill_w(row: dict[int, Op]) -> Slots:
    """One rank's W passes (slot -> pass ``row``, no W): each in the first free slot after its
    B, oldest B first."""
    out: Slots = {}
    pending: deque[Op] = deque()
    t, last = 0, max(row)
    while t <= last or pending:
        here = row.get(t)
        if here is not None and here.kind == "B":
            pending.append(Op("W", here.stage, here.mb))
        elif here is None and pending:
            out[pending.popleft()] = t
        t += 1
    return out


def _peak(row: dict[int, Op]) -> int:
    """Peak activation count of one rank's slots; without W passes, each W runs implicitly in
    the first free slot after its B (oldest first)."""
    explicit = any(op.kind == "W" for op in row.values())
    cur = peak = waiting = 0
    for t in range(max(row) + 1):
        op = row.get(t)
        if op is not None:
            cur += UNIT_MEM[op.kind]
            waiting += op.kind == "B"
        elif not explicit and waiting:
            cur, waiting = cur - 1, waiting - 1
        peak = max(peak, cur)
    return peak


def _move(slots: Slots, p: int, m: int, *, warm_up: bool, limit: int | None) -> Slots:
    """Move the cool-down's passes (and the warm-up's with ``warm_up``) to the earliest free
    slot after their inputs where the rank stays within the pattern's peak (or ``limit``)."""
    out = dict(slots)
    rows: dict[int, dict[int, Op]] = {}
    for op, t in out.items():
        rows.setdefault(_rank(op, p), {})[t] = op
    limit = max([_peak(row) for row in rows.values()] + ([limit] if limit else []))
    heap = [(t, _rank(op, p), _type(op, p), op.mb, op) for op, t in out.items()]
    heapq.heapify(heap)
    phase = 0  # 0 warm-up, 1 steady (kept), 2 cool-down
    while heap:
        t, r, _k, _j, op = heapq.heappop(heap)
        if phase == 0 and op.kind == "B" and op.stage == 0:
            phase = 1
        if phase == 1:
            phase += op.kind == "F" and op.stage == 0 and op.mb == m - 1
            continue
        if phase == 0 and not warm_up:
            continue
        ready = max((out[q] for q in _inputs(op, p) if q in out), default=-1) + 1
        row = rows[r]
        del row[t]
        for s in range(ready, t):
            if s in row:
                continue
            row[s] = op
            if _peak(row) <= limit:
                out[op] = s
                break
            del row[s]
        row[out[op]] = op
    return out


def _compact(slots: Slots, p: int) -> Slots:
    """Every pass as early as its inputs and its rank's previous pass allow, in slot order."""
    out: Slots = {}
    last = [-1] * p
    for op in sorted(slots, key=lambda o: (slots[o], _rank(o, p), _type(o, p), o.mb)):
        r = _rank(op, p)
        start = max([last[r], *(out[q] for q in _inputs(op, p) if q in out)]) + 1
        out[op] = last[r] = start
    return out
