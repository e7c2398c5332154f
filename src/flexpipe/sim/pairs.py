"""The transport check (rule ``pair-order``): a lowered schedule's point-to-point messages can be
matched in order, with no tags, and posting them as the runtime does cannot deadlock.

1. *Every message has both sides.* A message one side never posts is reported, naming both
   ranks and the message. (The order needs no agreement: the receiver posts a channel's
   receives in the sender's order, ``flexpipe.ir.pairs``.)
2. *Posting cannot deadlock.* The runtime's model, replayed op by op: each rank runs its ops in
   order; a receive op only posts its receives and every earlier message of their channels in
   the sender's order (the runtime may post them earlier, which can only help); a send op
   posts its sends when the data is ready and never waits; an op waits
   for the messages of the receives that gate it and for the ops it needs on other ranks (a
   gang's collective peers). On every channel the k-th send is matched with the k-th receive
   and a send blocks its channel until it is matched (a message arrives only when both sides
   have posted it and everything before it on the channel). Ranks left waiting are reported
   with the message each one waits for.
"""

from __future__ import annotations

from flexpipe.errors import Violation
from flexpipe.ir.around import around
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.ir.op import Op
from flexpipe.ir.pairs import COMM, Channel, Message, Mismatch, Transfers, mismatches, transfers
from flexpipe.ir.schedule import Schedule

RULE = "pair-order"


def pair_violations(schedule: Schedule, registry: KindRegistry = KINDS,
                    lookahead: int = 0, note: str = "") -> list[Violation]:
    """Violations of the transport rule by ``schedule`` (which holds its communication ops);
    ``lookahead``: how many ops ahead receives are posted; ``note`` prefixes each reason."""
    t = transfers(schedule)
    found = [_disagreement(schedule, mm, note) for mm in mismatches(t)]
    if found:
        return found
    return _replay(schedule, t, registry, lookahead, note)


def _disagreement(schedule: Schedule, mm: Mismatch, note: str) -> Violation:
    """The violation for a message only one side posts."""
    (a, b), (r, i) = mm.channel, mm.at
    op = schedule.ranks[r][i]
    if mm.received is None:
        assert mm.sent is not None
        reason = (f"rank {a} sends {mm.sent} to rank {schedule.placement.rank_of(mm.sent.dst)}"
                  f", which never receives it")
    else:
        reason = (f"rank {b} receives {mm.received} from rank "
                  f"{schedule.placement.rank_of(mm.received.src)}, which never sends it")
    return Violation(RULE, note + reason, r, i, str(op), around(schedule, r, i))


def _replay(schedule: Schedule, t: Transfers, registry: KindRegistry, lookahead: int,
            note: str) -> list[Violation]:
    """Run the runtime's posting model; a violation per rank left waiting."""
    state = _State(schedule, t, registry, lookahead)
    while state.advance():
        pass
    return [Violation(RULE, note + reason, r, state.ptr[r], str(schedule.ranks[r][state.ptr[r]]),
                      around(schedule, r, state.ptr[r])) for r, reason in state.stuck()]


class _State:
    """Hosts' positions and, per channel, how many sends and receives are posted."""

    def __init__(self, schedule: Schedule, t: Transfers, registry: KindRegistry,
                 lookahead: int) -> None:
        self.schedule, self.t, self.lookahead = schedule, t, max(0, lookahead)
        self.index = DepIndex(schedule, registry)
        self.where = {op: (r, i) for r, i, op in schedule.ops()}
        self.slot: dict[Message, tuple[Channel, int]] = {
            m: (ch, k) for ch, msgs in t.sent.items() for k, m in enumerate(msgs)}
        self.sends: dict[Channel, int] = dict.fromkeys(t.sent, 0)
        self.recvs: dict[Channel, int] = dict.fromkeys(t.sent, 0)
        self.ptr = [0] * schedule.num_ranks
        self.posted = [0] * schedule.num_ranks  # next op whose receives are not posted

    def advance(self) -> bool:
        """Move every rank as far as it can; whether any moved."""
        moved = False
        for r, ops in enumerate(self.schedule.ranks):
            while self.ptr[r] < len(ops):
                self._prefetch(r)
                op = ops[self.ptr[r]]
                spec = COMM.get(op.kind)
                if spec is not None and spec[1]:
                    self._post(r, self.ptr[r], self.sends)
                elif spec is None and self.waiting_for(op) is not None:
                    break
                self.ptr[r] += 1
                moved = True
        return moved

    def _prefetch(self, r: int) -> None:
        ops = self.schedule.ranks[r]
        last = min(len(ops) - 1, self.ptr[r] + self.lookahead)
        while self.posted[r] <= last:
            i = self.posted[r]
            spec = COMM.get(ops[i].kind)
            if spec is not None and not spec[1]:
                self._post(r, i, self.recvs)
            self.posted[r] += 1

    def _post(self, r: int, i: int, counts: dict[Channel, int]) -> None:
        """Post the op's messages and, on each channel, every message sent before them."""
        for msg, _peer in self.t.posts.get((r, i), ()):
            ch, k = self.slot[msg]
            counts[ch] = max(counts[ch], k + 1)

    def arrived(self, msg: Message) -> bool:
        """Whether both sides posted ``msg`` and everything before it on its channel."""
        ch, k = self.slot[msg]
        return k < min(self.sends[ch], self.recvs[ch])

    def waiting_for(self, op: Op) -> str | None:
        """What ``op`` still waits for (None: it may run)."""
        deps = [(dep, self.where[dep]) for dep in self.index.needs(op) if dep in self.where]
        for dep, at in deps:  # the messages first: that is what the transport waits for
            spec = COMM.get(dep.kind)
            if spec is not None and not spec[1]:
                late = [(m, peer) for m, peer in self.t.posts.get(at, ()) if not self.arrived(m)]
                if late:
                    return f"message {late[0][0]} from rank {late[0][1]}"
        for dep, (r, i) in deps:
            if dep.kind not in COMM and self.ptr[r] <= i:
                return f"{dep} on rank {r}"
        return None

    def stuck(self) -> list[tuple[int, str]]:
        """(rank, reason) of every rank that could not finish."""
        out = []
        for r, ops in enumerate(self.schedule.ranks):
            if self.ptr[r] < len(ops):
                what = self.waiting_for(ops[self.ptr[r]])
                out.append((r, f"deadlock in the transport: rank {r} waits at "
                               f"{ops[self.ptr[r]]} for {what}"))
        return out
