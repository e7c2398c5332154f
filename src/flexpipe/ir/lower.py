"""Lowering: add point-to-point communication to a compute-only schedule (Schedule -> Schedule,
never mutating its input; standard library only).

For every edge of the stage graph whose two stages sit on different ranks:

- ``SEND_F(s, j)`` right after ``F(s, j)`` on the producer's rank, ``RECV_F(t, j)`` on the
  consumer's rank right before ``F(t, j)``;
- ``SEND_B(t, j)`` right after ``B(t, j)`` / ``BW(t, j)`` on the consumer's rank, ``RECV_B(s, j)``
  on the producer's rank right before its ``B(s, j)`` / ``BW(s, j)``.

Stages on the same rank hand tensors over locally and get no op. A receive is where the
receive is *posted*: it waits for nothing; the op it gates waits for the data (as the runtime
does, and as the simulator times it: the gated op waits for its producer plus the transfer).

Nothing is reordered to agree on an order per rank pair: transfers are matched in order with
no tags, and the receiver posts a channel's receives in the sender's order whatever order its
receive ops come in (``flexpipe.ir.pairs``), so a receive stays right before the op it gates
(holding no buffer earlier than the sender's order makes it) and a send right after its data.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import heads, slots
from flexpipe.ir.schedule import Schedule

COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
BACKWARD = ("B", "BW")


def comm_stages(schedule: Schedule) -> dict[str, frozenset[int]]:
    """For each communication kind, the stages that get an op of that kind."""
    return transfer_stages(schedule.graph, schedule.placement.stage_rank)


def transfer_stages(graph: StageGraph, rank: Sequence[int]) -> dict[str, frozenset[int]]:
    """``comm_stages`` of a stage graph whose stage s sits on rank ``rank[s]``."""
    stages = range(graph.num_stages)
    recv_f = frozenset(s for s in stages if any(rank[p] != rank[s] for p in graph.preds[s]))
    recv_b = frozenset(s for s in stages if any(rank[t] != rank[s] for t in graph.succs[s]))
    send_f = frozenset(s for s in stages if any(rank[t] != rank[s] for t in graph.succs[s]))
    send_b = frozenset(s for s in stages if any(rank[p] != rank[s] for p in graph.preds[s]))
    return {"SEND_F": send_f, "RECV_F": recv_f, "SEND_B": send_b, "RECV_B": recv_b}


def lower(schedule: Schedule) -> Schedule:
    """``schedule`` with SEND_F/RECV_F/SEND_B/RECV_B ops added (see the module docstring).
    A schedule that already holds communication ops is returned unchanged."""
    if schedule.kinds() & set(COMM_KINDS):
        return schedule
    return insert_comm(schedule)


def insert_comm(schedule: Schedule) -> Schedule:
    """The lowering itself: each send right after the op that makes its data, each receive
    right before the op it gates."""
    where = comm_stages(schedule)
    pairs = heads(schedule.overlaps)
    return schedule.with_ranks([_lower_rank(ops, where, pairs) for ops in schedule.ranks])


def receive_for(op: Op, where: dict[str, frozenset[int]]) -> Op | None:
    """The receive that gates ``op``, if any."""
    if op.kind == "F" and op.stage in where["RECV_F"]:
        return Op("RECV_F", op.stage, op.mb)
    if op.kind in BACKWARD and op.stage in where["RECV_B"]:
        return Op("RECV_B", op.stage, op.mb)
    return None


def send_after(op: Op, where: dict[str, frozenset[int]]) -> Op | None:
    """The send that follows ``op``, if any."""
    if op.kind == "F" and op.stage in where["SEND_F"]:
        return Op("SEND_F", op.stage, op.mb)
    if op.kind in BACKWARD and op.stage in where["SEND_B"]:
        return Op("SEND_B", op.stage, op.mb)
    return None


def _lower_rank(ops: tuple[Op, ...], where: dict[str, frozenset[int]],
                pairs: dict[Op, Op]) -> list[Op]:
    """One rank's ops with its sends and receives inserted; an overlapped pair stays together,
    both receives before it and both sends after it."""
    out: list[Op] = []
    for unit in slots(ops, pairs):
        out += [r for r in (receive_for(o, where) for o in unit) if r is not None]
        out += unit
        out += [s for s in (send_after(o, where) for o in unit) if s is not None]
    return out

