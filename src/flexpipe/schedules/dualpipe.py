"""DualPipeV: DeepSeek's DualPipe cut in half onto a V placement, a forward of one micro-batch
overlapped with the full backward of another in its steady phase (DeepSeek-AI, "DeepSeek-V3
Technical Report", 2024, section 3.2.1; the V form by Sea AI Lab, "Cut-in-half", 2025).

Rank r holds stages r (the way down, phase 0) and 2p-1-r (the way up, phase 1). Its order,
written as DeepSeek's eight steps with n the micro-batches and p the ranks:

1. 2(p-r-1) forwards of phase 0;
2. r+1 times a forward of each phase;
3. p-r-1 times: B of phase 1 (its W queued), that W, a forward of phase 1;
4. n-2p+r+1 times: F of phase 0 overlapped with BW of phase 1, then F of phase 1 overlapped
   with BW of phase 0 (the last rank runs the very first pair one after the other: its
   forward feeds its own backward);
5. p-r-1 times: BW of phase 1, then F of phase 1 overlapped with BW of phase 0;
6. r+1 times a backward of each phase, the second half split (B now, W queued);
7. p-r-1 times: a queued W, then B of phase 0 (its W queued);
8. the queued Ws.

The per-rank order equals torch.distributed.pipelining's ``ScheduleDualPipeV`` with each
``OVERLAP_F_B`` kept as an overlapped pair (``flexpipe.ir.overlap``). Pure: no torch."""

from __future__ import annotations

from collections import deque

from flexpipe.errors import InfeasibleError
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import Pair
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule


class RankOrder:
    """One rank's order being written: per (kind, phase) micro-batch counters, the queue of
    deferred weight passes, the ops and the overlapped pairs."""

    def __init__(self, stages: tuple[int, int]) -> None:
        self.stages = stages
        self.next: dict[tuple[str, int], int] = {}
        self.queue: deque[Op] = deque()
        self.ops: list[Op] = []
        self.pairs: list[Pair] = []

    def _op(self, kind: str, phase: int, counter: str) -> Op:
        key = (counter, phase)
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        op = Op(kind, self.stages[phase], mb)
        self.ops.append(op)
        return op

    def f(self, phase: int) -> Op:
        """A forward of ``phase``."""
        return self._op("F", phase, "F")

    def b(self, phase: int, split: bool = False) -> Op:
        """A backward of ``phase``: fused (BW), or with ``split`` B now and its W queued."""
        op = self._op("B" if split else "BW", phase, "B")
        if split:
            self.queue.append(Op("W", op.stage, op.mb))
        return op

    def w(self) -> None:
        """The oldest queued weight pass."""
        self.ops.append(self.queue.popleft())

    def fb(self, forward: int, backward: int) -> None:
        """A forward of one phase overlapped with a fused backward of the other."""
        self.pairs.append((self.f(forward), self.b(backward)))


def rank_order(stages: tuple[int, int], r: int, p: int, n: int) -> RankOrder:
    """The order of rank r of p holding ``stages`` (phase 0, phase 1) with n micro-batches
    through each (module docstring); DualPipe gives each half of its ranks this order with r
    its distance from the nearer end (``dualpipe``)."""
    out = RankOrder(stages)
    for _ in range(2 * (p - r - 1)):
        out.f(0)
    for _ in range(r + 1):
        out.f(0)
        out.f(1)
    for _ in range(p - r - 1):
        out.b(1, split=True)
        out.w()
        out.f(1)
    for i in range(n - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            out.f(0)
            out.b(1)
        else:
            out.fb(0, 1)
        out.fb(1, 0)
    for _ in range(p - r - 1):
        out.b(1)
        out.fb(1, 0)
    _drain(out, r, p)
    return out


def _drain(out: RankOrder, r: int, p: int) -> None:
    """Steps 6 to 8: the last backwards, the second half of step 6 split, then the queue."""
    split = False
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        out.b(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        out.b(0, split)
    for _ in range(p - r - 1):
        out.w()
        out.b(0, split=True)
    while out.queue:
        out.w()


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV: a V placement whose steady phase overlaps a forward with another
    micro-batch's backward on each rank (module docstring); needs m >= 2p."""
    if m < 2 * p:
        raise InfeasibleError(f"dualpipev needs at least 2p = {2 * p} micro-batches, got {m}")
    ranks = [rank_order((r, 2 * p - 1 - r), r, p, m) for r in range(p)]
    sched = Schedule.build([rank.ops for rank in ranks], Placement.vshape(p), m,
                           name="dualpipev")
    return sched.with_overlaps(pair for rank in ranks for pair in rank.pairs)
