"""The messages of a lowered schedule and the order each rank pair agrees on (standard library
only; shared by the lowering, the validator and the runtime).

A *message* is one stage-graph edge crossing ranks, for one micro-batch, in one direction:
``F`` carries stage ``src``'s output to stage ``dst`` (sent by ``SEND_F(src)``, received by
``RECV_F(dst)``), ``B`` carries stage ``src``'s input gradient back to its producer ``dst``
(``SEND_B(src)`` -> ``RECV_B(dst)``). A *channel* is an ordered rank pair (sender, receiver).

Transfers are matched in order, with no tags (as NCCL matches them): on every channel the k-th
send meets the k-th receive. The receiver therefore posts a channel's receives in the order the
sender sends them, whatever order its own receive ops come in: a receive op posts its messages
and every message the sender sends before them on that channel (into buffers held until their
own op takes them). So any receive order is matched correctly, a skip edge whose message is
sent long before (or after) its neighbours' included. The order is read off the ops' positions:
the sender posts a send op's messages when it reaches the op; two messages of one op are
ordered by the other side's positions. ``transfers`` derives all of it once (``received`` keeps
the receiver's own op order, which the lowering aligns with the sender's where it can, so that
buffers are not held early); ``mismatches`` names every message only one side posts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule

Channel = tuple[int, int]  # (sending rank, receiving rank)
Pos = tuple[int, int]  # (rank, position) of a send or receive op
# comm kind -> (direction, True for a send, the neighbours it talks to: "succ" or "pred")
COMM: dict[str, tuple[str, bool, str]] = {
    "SEND_F": ("F", True, "succ"), "RECV_F": ("F", False, "pred"),
    "SEND_B": ("B", True, "pred"), "RECV_B": ("B", False, "succ"),
}
UNSET = 1 << 62


class Message(NamedTuple):
    """One transfer: direction ``kind`` (F activations, B gradients) from stage ``src`` to
    stage ``dst`` for micro-batch ``mb``; printed ``F3 0>1``."""

    kind: str
    src: int
    dst: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.mb} {self.src}>{self.dst}"


@dataclass(frozen=True)
class Mismatch:
    """The first disagreement on one channel: ``sent`` is what the sender posts as its
    ``index``-th message, ``received`` what the receiver posts there (None: nothing)."""

    channel: Channel
    index: int
    sent: Message | None
    received: Message | None
    at: Pos  # the op to point at in an error


@dataclass(frozen=True)
class Transfers:
    """Every message of a lowered schedule. ``posts[(rank, position)]``: the (message, peer
    rank) pairs a send or receive op posts, in posting order; ``sent[channel]`` /
    ``received[channel]``: the messages as the sender / the receiver post them;
    ``send_at`` / ``recv_at``: where each message is sent / received."""

    posts: dict[Pos, tuple[tuple[Message, int], ...]]
    sent: dict[Channel, tuple[Message, ...]]
    received: dict[Channel, tuple[Message, ...]]
    send_at: dict[Message, Pos]
    recv_at: dict[Message, Pos]

    def channels(self) -> list[Channel]:
        """Every channel that carries a message, sorted."""
        return sorted(set(self.sent) | set(self.received))


def op_messages(op: Op, rank: int, schedule: Schedule) -> list[tuple[Message, int]]:
    """(message, peer rank) of each transfer a communication op on ``rank`` takes part in, in
    stage-graph order ([] for other ops)."""
    spec = COMM.get(op.kind)
    if spec is None:
        return []
    direction, sends, toward = spec
    graph, stage_rank = schedule.graph, schedule.placement.stage_rank
    if not 0 <= op.stage < graph.num_stages:
        return []
    peers = graph.succs[op.stage] if toward == "succ" else graph.preds[op.stage]
    out = []
    for peer in peers:
        if stage_rank[peer] == rank:
            continue
        msg = Message(direction, op.stage, peer, op.mb) if sends else \
            Message(direction, peer, op.stage, op.mb)
        out.append((msg, stage_rank[peer]))
    return out


def transfers(schedule: Schedule) -> Transfers:
    """Derive every message, where it is sent and received, and each channel's two orders."""
    send_at: dict[Message, Pos] = {}
    recv_at: dict[Message, Pos] = {}
    raw: dict[Pos, tuple[bool, list[tuple[Message, int]]]] = {}
    for r, i, op in schedule.ops():
        found = op_messages(op, r, schedule)
        if not found:
            continue
        is_send = COMM[op.kind][1]
        raw[(r, i)] = (is_send, found)
        table = send_at if is_send else recv_at
        for msg, _peer in found:
            table.setdefault(msg, (r, i))
    posts: dict[Pos, tuple[tuple[Message, int], ...]] = {}
    for at, (is_send, found) in raw.items():
        other = recv_at if is_send else send_at
        posts[at] = tuple(sorted(found, key=lambda mp: (mp[1], other.get(mp[0], (0, UNSET))[1])))
    sent = _orders(send_at, recv_at, sender=True)
    received = _orders(recv_at, send_at, sender=False)
    return Transfers(posts, sent, received, send_at, recv_at)


def _orders(mine: dict[Message, Pos], theirs: dict[Message, Pos],
            sender: bool) -> dict[Channel, tuple[Message, ...]]:
    """Per channel, the messages in the order this side posts them: by this side's op position,
    ties (one op) by the other side's."""
    keyed: dict[Channel, list[tuple[int, int, Message]]] = {}
    for msg, (r, i) in mine.items():
        peer = theirs.get(msg)
        other = peer[1] if peer is not None else UNSET
        peer_rank = peer[0] if peer is not None else -1
        channel = (r, peer_rank) if sender else (peer_rank, r)
        keyed.setdefault(channel, []).append((i, other, msg))
    return {ch: tuple(m for _i, _o, m in sorted(items)) for ch, items in keyed.items()
            if -1 not in ch}


def mismatches(t: Transfers) -> list[Mismatch]:
    """Every message posted on one side only (the receiver posts in the sender's order, so
    messages received in another order than sent are matched all the same)."""
    out: list[Mismatch] = []
    for msg, at in sorted(t.send_at.items(), key=lambda kv: kv[1]):
        if msg not in t.recv_at:
            out.append(Mismatch((at[0], -1), 0, msg, None, at))
    for msg, at in sorted(t.recv_at.items(), key=lambda kv: kv[1]):
        if msg not in t.send_at:
            out.append(Mismatch((-1, at[0]), 0, None, msg, at))
    return out
