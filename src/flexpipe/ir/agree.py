"""One agreed order per rank pair: move a lowered schedule's sends and receives so that, on every
channel, the receiver receives the messages in the order the sender sends them (transfers are
matched in order, with no tags; ``flexpipe.ir.pairs``). Standard library only.

Two moves, neither of which reorders compute:

- *pull*: a receive moves earlier, just before the first receive (on its rank) of a message its
  sender sends later. A receive op only posts the receive (it waits for nothing; the op it gates
  waits for the data), so posting earlier adds no wait: it only holds the buffer sooner.
- *push*: where pulling cannot help (one receive op takes several messages from one sender, a
  join whose producers share a rank, and another message of the channel was sent between
  them), the send of the first message sent too early moves down, right after the send of the
  last message the receiver takes before it.

Both repeat until every channel agrees. A push delays a transfer (and could in principle make
ranks wait on each other, which the validator would name); the library's chains and V shapes
need none. Where no order exists with one receive op per stage (two stages of one rank both
feeding two stages of another), the result still disagrees and the validator names the
channel.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from flexpipe.ir.op import Op
from flexpipe.ir.pairs import COMM, Transfers, transfers
from flexpipe.ir.schedule import Schedule

ROUNDS = 64


def agree(schedule: Schedule) -> Schedule:
    """``schedule`` (with communication ops) with its sends and receives moved so that every
    channel agrees (see the module docstring); compute ops keep their order."""
    for _ in range(ROUNDS):
        schedule = _pull(schedule)
        t = transfers(schedule)
        moves = _pushes(t)
        if not moves:
            break
        schedule = schedule.with_ranks([_move_down(ops, moves.get(r, {}))
                                        for r, ops in enumerate(schedule.ranks)])
    return schedule


def _is_recv(op: Op) -> bool:
    spec = COMM.get(op.kind)
    return spec is not None and not spec[1]


def _move_down(ops: Sequence[Op], moves: dict[int, int]) -> list[Op]:
    """``ops`` with the op at each key of ``moves`` placed right before the op at its value
    (followed through ops that move too; ``len(ops)``: at the end)."""
    if not moves:
        return list(ops)
    anchor: dict[int, list[int]] = {}
    for q in sorted(moves):
        a = moves[q]
        while a in moves and a != q:
            a = moves[a]
        anchor.setdefault(a, []).append(q)
    out: list[Op] = []
    for i, op in enumerate(ops):
        out += [ops[q] for q in anchor.get(i, ())]
        if i not in moves:
            out.append(op)
    return out + [ops[q] for q in anchor.get(len(ops), ())]


def _pull(schedule: Schedule) -> Schedule:
    """Move receives earlier until, on every channel, they follow the sender's order."""
    t = transfers(schedule)
    before: dict[int, dict[int, set[int]]] = {}  # rank -> receive position -> must precede
    for (_a, b), msgs in t.sent.items():
        spans: dict[int, tuple[int, int]] = {}  # receive position -> first, last send position
        for m in msgs:
            y, x = t.recv_at[m][1], t.send_at[m][1]
            lo, hi = spans.get(y, (x, x))
            spans[y] = (min(lo, x), max(hi, x))
        for y, z in _precedence(spans):
            before.setdefault(b, {}).setdefault(y, set()).add(z)
    ranks = [_place(ops, before.get(r, {})) for r, ops in enumerate(schedule.ranks)]
    return schedule.with_ranks(ranks)


def _precedence(spans: dict[int, tuple[int, int]]) -> list[tuple[int, int]]:
    """(y, z): receive op y must come before z, each with the first and last send positions
    of its messages on one channel. y precedes z when all of y's messages are sent no later
    than z's first (one send op may serve both, in either order), and they are not both
    served by that one send op only. Edges to the next level suffice (the rest follows); a
    level holding receives served by y's one send op only (a star: one send op feeds several
    receive ops) is looked through to the level after it, which no such receive links to y."""
    firsts = sorted((lo, y) for y, (lo, _hi) in spans.items())
    keys = [lo for lo, _y in firsts]
    out = []
    for y, (lo, hi) in spans.items():
        i = bisect.bisect_left(keys, hi)
        while i < len(keys):
            level, through = keys[i], False
            while i < len(keys) and keys[i] == level:
                z = firsts[i][1]
                if z != y and lo < spans[z][1]:
                    out.append((y, z))
                else:
                    through = True
                i += 1
            if not through:
                break
    return out


def _place(ops: Sequence[Op], before: dict[int, set[int]]) -> list[Op]:
    """Each receive right before the op it gates or, if earlier, before the anchor of every
    receive it must precede; receives sharing an anchor in an order that keeps ``before``."""
    if not before:
        return list(ops)
    anchor: dict[int, int] = {}
    nxt = len(ops)
    for i in range(len(ops) - 1, -1, -1):
        if _is_recv(ops[i]):
            anchor[i] = nxt
        else:
            nxt = i
    order = _topological(sorted(anchor), before)
    for y in reversed(order):
        anchor[y] = min([anchor[y], *(anchor[z] for z in before.get(y, ()) if z in anchor)])
    groups: dict[int, list[int]] = {}
    for y in order:
        groups.setdefault(anchor[y], []).append(y)
    out: list[Op] = []
    for i, op in enumerate(ops):
        out += [ops[y] for y in groups.get(i, ())]
        if not _is_recv(op):
            out.append(op)
    return out + [ops[y] for y in groups.get(len(ops), ())]


def _topological(nodes: list[int], before: dict[int, set[int]]) -> list[int]:
    """``nodes`` with each before every node it must precede, otherwise by position (a cycle,
    which no order satisfies, is broken by position)."""
    indegree = dict.fromkeys(nodes, 0)
    for y in nodes:
        for z in before.get(y, ()):
            if z in indegree:
                indegree[z] += 1
    ready = [y for y in nodes if indegree[y] == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        y = heapq.heappop(ready)
        out.append(y)
        for z in before.get(y, ()):
            if z in indegree:
                indegree[z] -= 1
                if indegree[z] == 0:
                    heapq.heappush(ready, z)
    seen = set(out)
    return out + [y for y in nodes if y not in seen]


def _pushes(t: Transfers) -> dict[int, dict[int, int]]:
    """For each channel still out of order, the first message sent too early: its send moves
    right after the send of the last message the receiver takes before it."""
    moves: dict[int, dict[int, int]] = {}
    for ch, msgs in t.sent.items():
        if t.received.get(ch) == msgs:
            continue
        for k, m in enumerate(msgs):
            got = t.recv_at[m][1]
            later = [n for n in msgs[k + 1:] if t.recv_at[n][1] < got]
            if later:
                last = max(t.send_at[n][1] for n in later)
                moves.setdefault(ch[0], {})[t.send_at[m][1]] = last + 1
                break
    return moves
