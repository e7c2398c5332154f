"""When a sent message is certainly consumed, read off a lowered schedule (standard library only).

A sender may let go of a message's buffers once the transfer has completed, but some transports
(gloo) only say so when asked to wait, and waiting on a send the receiver has not posted yet can
block a rank that the receiver is itself waiting on. A *proof* of message M (sent by rank r to
rank q) is the first message N that q sends back to r after the op that consumes M: the first op
on q after M's receive, on M's stage and micro-batch, that the receive gates (per the kind
registry; it waits for the data). Once r has N's data, q had M's data before it sent N, so
waiting on M's send returns at once: no schedule can make it wait on r.
"""

from __future__ import annotations

from flexpipe.ir.kinds import KINDS
from flexpipe.ir.pairs import Message, Transfers
from flexpipe.ir.schedule import Schedule

RECV_OF = {"F": "RECV_F", "B": "RECV_B"}


def _consumer(schedule: Schedule, t: Transfers, msg: Message) -> int | None:
    """Position, on its receiving rank, of the first op that waits for ``msg``'s data."""
    rank, at = t.recv_at[msg]
    recv = RECV_OF[msg.kind]
    gated = {k for gate in KINDS[recv].gates for k in gate.kinds}
    for i in range(at + 1, len(schedule.ranks[rank])):
        op = schedule.ranks[rank][i]
        if op.kind in gated and (op.stage, op.mb) == (msg.dst, msg.mb):
            return i
    return None


def proofs(schedule: Schedule, t: Transfers, rank: int) -> dict[Message, Message]:
    """For each message ``rank`` sends, the message back from its receiver whose arrival proves
    it consumed (no entry: nothing in the step proves it; the step's end waits for it)."""
    out: dict[Message, Message] = {}
    for msg, (src, _at) in t.send_at.items():
        if src != rank or msg not in t.recv_at:
            continue
        peer = t.recv_at[msg][0]
        used = _consumer(schedule, t, msg)
        if used is None:
            continue
        back = t.sent.get((peer, rank), ())
        later = [n for n in back if t.send_at[n][1] > used]
        if later:
            out[msg] = later[0]
    return out
