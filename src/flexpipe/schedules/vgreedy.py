"""Adaptive V: a cost-aware greedy for the V placement under any activation limit (the
controllable-memory paper's adaptive scheduler and the zero-bubble paper's ZB-V greedy, section
6, written from their descriptions).

Rank i holds the down stage i and the up stage 2p-1-i. The greedy times passes as it places
them (start = max(rank free, input arrived), transfers from the cost model):

1. warm-up: one forward down the V; then, from the last rank up, each rank takes extra down
   forwards (with every rank before it) while its memory leaves room for (1 + i) more
   micro-batches and the first up forward has not arrived; then it takes that up forward. Ranks
   are then topped up, up and down chunks in turn, until each holds as many forwards as the one
   before it.
2. steady rounds: every rank takes one B (the down chunk's as soon as its gradient is placed,
   else the up chunk's), then one F (the up chunk's when its input is placed). A pending W goes
   first when memory needs it, when it ends before the next pass's input arrives (it fills a
   bubble), or when waiting would cost the rank more idle time than the worst rank has so far
   (``fill_b`` / ``fill_f``: also before a B of the up chunk / before an F).
3. the remaining W passes.

Each run records the idle time per rank; it is run again with that as the approved idle time
(a rank that idled less may idle up to the worst) until the worst idle time stops falling.
Variants (fill_b, fill_f, warm-up cap m or m - i) are tried and the one with the smallest
largest per-rank span is kept.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import product

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import stage_transfer
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import remembered

EPS = 1e-9
WARM_UPS = ("m", "m-i", "target")  # warm-up rules (``_Run.warm_up``)
REFINE = 4  # reruns with the last run's idle times approved, at most


Table = dict[tuple[str, int], float]


def _tables(p: int, cost: CostModel, pl: Placement) -> tuple[Table, Table, Table]:
    """Per (kind, stage): its time, its change of activation memory, and the transfer time of
    its input from the rank of the pass it waits for (0 on the same rank)."""
    time, dmem, xfer = {}, {}, {}
    for s in range(2 * p):
        st = cost.stage(s)
        for kind, d in (("F", st.act), ("B", st.wact - st.act), ("W", -st.wact)):
            time[(kind, s)], dmem[(kind, s)] = st.time(kind), d
        xfer[("F", s)] = stage_transfer(cost, pl, s - 1, s, s - 1) if s > 0 else 0.0
        xfer[("B", s)] = stage_transfer(cost, pl, s + 1, s, s) if s < 2 * p - 1 else 0.0
    return time, dmem, xfer


class _Stuck(Exception):
    """The greedy cornered itself (memory full, no W to free it, or an input never placed)."""


@dataclass
class _Run:
    """One greedy pass: its settings and its mutable state."""

    p: int
    m: int
    cost: CostModel
    limit: float
    fill_b: bool
    fill_f: bool
    warm: str
    approved: list[float] | None
    give_up: float = float("inf")  # stop once the worst idle time reaches this (_refined)
    pl: Placement = field(init=False)
    end: dict[tuple[str, int, int], float] = field(default_factory=dict)  # Op -> its end
    count: dict[tuple[str, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pl = Placement.vshape(self.p)
        self.rank_of = self.pl.stage_rank
        self.last = 2 * self.p - 1  # the last stage
        self.time, self.dmem, self.xfer = _tables(self.p, self.cost, self.pl)
        self.cur = [0.0] * self.p
        self.mem = [0.0] * self.p
        self.idle = [0.0] * self.p
        self.worst = 0.0  # max(self.idle), kept as idle times only grow
        self.left = 4 * self.p  # (F or B, stage) pairs with passes still to place
        self.worst_approved = max(self.approved) if self.approved is not None else 0.0
        self.started = [False] * self.p
        self.pending: list[deque[Op]] = [deque() for _ in range(self.p)]
        self.orders: list[list[Op]] = [[] for _ in range(self.p)]

    # -- basic moves ---------------------------------------------------------------------------
    def down(self, i: int) -> int:
        return i

    def up(self, i: int) -> int:
        return 2 * self.p - 1 - i

    def n(self, kind: str, s: int) -> int:
        return self.count.get((kind, s), 0)

    def dep(self, kind: str, s: int, mb: int) -> tuple[str, int, int] | None:
        """The pass (kind, stage, mb) on another stage that ``kind`` of stage s, micro-batch
        mb, waits for."""
        if kind == "F":
            return ("F", s - 1, mb) if s > 0 else None
        return ("B", s + 1, mb) if s < self.last else ("F", s, mb)

    def arrival(self, kind: str, s: int, mb: int) -> float | None:
        """When the input of the pass is on its rank; None while its producer is not placed."""
        if kind == "F":
            if s == 0:
                return 0.0
            end = self.end.get(("F", s - 1, mb))
        else:
            end = self.end.get(("B", s + 1, mb) if s < self.last else ("F", s, mb))
        return None if end is None else end + self.xfer[(kind, s)]

    def delta(self, op: Op) -> float:
        return self.dmem[(op.kind, op.stage)]

    def put(self, kind: str, s: int) -> None:
        i, mb = self.rank_of[s], self.count.get((kind, s), 0)
        ready = self.arrival(kind, s, mb) if kind != "W" else self.end.get(("B", s, mb))
        if ready is None or mb >= self.m:
            raise _Stuck(f"{Op(kind, s, mb)} not ready")
        if kind == "B" and ("F", s, mb) not in self.end:
            raise _Stuck(f"{Op(kind, s, mb)} before its forward")
        delta = self.dmem[(kind, s)]
        if self.mem[i] + delta > self.limit + EPS:
            raise _Stuck(f"{Op(kind, s, mb)} over memory")
        cur = self.cur[i]
        start = cur if cur > ready else ready
        if self.started[i]:
            self.idle[i] += start - cur
            if self.idle[i] > self.worst:
                self.worst = self.idle[i]
                if self.worst >= self.give_up:
                    raise _Stuck("no better than the run it refines")
        self.started[i] = True
        op = Op(kind, s, mb)
        self.end[op] = self.cur[i] = start + self.time[(kind, s)]
        self.mem[i] += delta
        self.orders[i].append(op)
        self.count[(kind, s)] = mb + 1
        self.left -= kind != "W" and mb + 1 == self.m
        if kind == "B":
            self.pending[i].append(Op("W", s, mb))

    def put_w(self, i: int) -> None:
        if not self.pending[i]:
            raise _Stuck(f"rank {i}: memory full and no W to run")
        w = self.pending[i].popleft()
        self.put("W", w.stage)

    def allowed_idle(self, i: int) -> float:
        worst = self.worst
        if self.approved is not None:
            worst = max(worst, self.worst_approved - self.approved[i])
        return worst - self.idle[i]

    def before(self, i: int, kind: str, s: int, fill: bool) -> None:
        """W passes that go before the pass (kind, s) on rank i (module docstring)."""
        mb = self.count.get((kind, s), 0)
        delta = self.dmem[(kind, s)]
        while self.mem[i] + delta > self.limit + EPS:
            self.put_w(i)
        d = self.dep(kind, s, mb)
        if d is None or self.rank_of[d[1]] == i:
            return
        arrive = self.arrival(kind, s, mb)
        if arrive is None:
            raise _Stuck(f"{Op(kind, s, mb)}: input not placed")
        while self.pending[i] and arrive >= self.cur[i] + self._w_time(i) - EPS:
            self.put_w(i)
        if self.pending[i] and arrive - self.cur[i] > self.allowed_idle(i) + EPS and fill:
            self.put_w(i)

    def _w_time(self, i: int) -> float:
        return self.time[("W", self.pending[i][0].stage)]

    # -- phases --------------------------------------------------------------------------------
    def warm_up(self) -> None:
        if self.warm == "target":
            self._warm_up_target()
            return
        p, m = self.p, self.m
        for i in range(p):
            self.put("F", self.down(i))
        for i in reversed(range(p)):
            if i < p - 1:
                cap = m - i if self.warm == "m-i" else m
                arrive = self.arrival("F", self.up(i), 0)
                assert arrive is not None
                room = (1 + i) * (self._act(self.down(i)) + self._act(self.up(i)))
                while (self.mem[i] + room <= self.limit + EPS and self.n("F", self.down(i)) < cap
                       and self.cur[i] + self.cost.stage(i).time("F") <= arrive + EPS):
                    for j in range(i + 1):
                        self.put("F", self.down(j))
            self.put("F", self.up(i))
        self._top_up()

    def _warm_up_target(self) -> None:
        """Warm-up for a limit of k chunk activations: rank i runs min(i + 1, k // 2) up
        forwards and k minus that many down forwards before its first B."""
        p, m = self.p, self.m
        k = [int((self.limit + EPS) // ((self._act(self.down(i)) + self._act(self.up(i))) / 2))
             for i in range(p)]
        want_up = [min(m, i + 1, max(1, k[i] // 2)) for i in range(p)]
        want_down = [min(m, max(1, k[i] - want_up[i])) for i in range(p)]
        placed = True
        while placed:
            placed = False
            for i in range(p):
                if self.n("F", self.down(i)) < want_down[i] and self._can_put("F", self.down(i)):
                    self.put("F", self.down(i))
                    placed = True
            for i in reversed(range(p)):
                nu = self.n("F", self.up(i))
                first = min(want_down[i], 2 * (p - 1 - i) + 1 + nu)  # downs before this up
                if (nu < want_up[i] and self.n("F", self.down(i)) >= first
                        and self._can_put("F", self.up(i))):
                    self.put("F", self.up(i))
                    placed = True

    def _can_put(self, kind: str, s: int) -> bool:
        """Whether the next ``kind`` pass of stage s has its input placed and fits in memory."""
        mb = self.n(kind, s)
        op = Op(kind, s, mb)
        return (mb < self.m and self.arrival(kind, s, mb) is not None
                and self.mem[self.pl.stage_rank[s]] + self.delta(op) <= self.limit + EPS)

    def _act(self, s: int) -> float:
        return self.cost.stage(s).act

    def _total(self, i: int) -> int:
        return self.n("F", self.down(i)) + self.n("F", self.up(i))

    def _top_up(self) -> None:
        p, m, chunk = self.p, self.m, 0
        for i in range(1, p):
            stalled = 0
            while stalled < 2:  # both chunks tried without a pass placed: memory is full
                ups = self.n("F", self.up(i)), self.n("F", self.up(i - 1))
                if not (self._total(i) < self._total(i - 1) or ups[0] <= ups[1] < m):
                    break
                ranks = range(i, p) if chunk == 0 else reversed(range(i, p))
                placed = False
                for j in ranks:
                    s = self.down(j) if chunk == 0 else self.up(j)
                    if self._can_put("F", s):
                        self.put("F", s)
                        placed = True
                stalled = 0 if placed else stalled + 1
                chunk = 1 - chunk

    def steady(self) -> None:
        for _ in range(6 * self.m + 4 * self.p):
            if self.left <= 0:  # every F and B placed
                break
            downs: list[int] = []
            ups: list[int] = []
            for i in range(self.p):
                (downs if self._b_down(i) else ups).append(i)
            for i in reversed(downs):
                self._place(i, "B", self.down(i), True)
            for i in ups:
                self._place(i, "B", self.up(i), self.fill_b)
            for i in range(self.p):
                s = self._f_choice(i)
                if s is not None:
                    self._place(i, "F", s, self.fill_f)
        for i in range(self.p):
            while self.pending[i]:
                self.put_w(i)

    def _place(self, i: int, kind: str, s: int, fill: bool) -> None:
        """Place the pass if its input is placed (after the W passes that go first)."""
        mb = self.n(kind, s)
        if mb >= self.m or self.arrival(kind, s, mb) is None:
            return
        if kind == "B" and ("F", s, mb) not in self.end:
            return
        if kind == "F" and not self.pending[i] and \
                self.mem[i] + self.dmem[(kind, s)] > self.limit + EPS:
            return
        self.before(i, kind, s, fill)
        self.put(kind, s)

    def _b_down(self, i: int) -> bool:
        nd, nu = self.n("B", self.down(i)), self.n("B", self.up(i))
        if nd >= nu:
            return False
        if i == self.p - 1:
            return True
        return ("B", self.down(i + 1), nd) in self.end or nu >= self.m

    def _f_choice(self, i: int) -> int | None:
        d, u = self.down(i), self.up(i)
        nd, nu = self.n("F", d), self.n("F", u)
        if nu >= self.m:
            return None
        if nu >= nd:
            return d
        if i == self.p - 1 or ("F", self.up(i + 1), nu) in self.end:
            return u
        if nd < self.m and (i == 0 or ("F", d - 1, nd) in self.end):
            return d
        return None

    def spans(self) -> list[float]:
        """Per rank, first pass start to last pass end."""
        out = []
        for order in self.orders:
            first = order[0]
            start = self.end[first] - self.cost.stage(first.stage).time(first.kind)
            out.append(self.end[order[-1]] - start)
        return out


def _attempt(p: int, m: int, cost: CostModel, limit: float, fill_b: bool, fill_f: bool,
             warm: str, approved: list[float] | None,
             give_up: float = float("inf")) -> _Run | None:
    """One greedy run; None when it corners itself or its worst idle time reaches
    ``give_up`` (idle times only grow, so it could not end below that)."""
    run = _Run(p, m, cost, limit, fill_b, fill_f, warm, approved, give_up)
    try:
        run.warm_up()
        run.steady()
    except _Stuck:
        return None
    if sum(len(o) for o in run.orders) != 6 * p * m:
        return None
    return run


def _refined(p: int, m: int, cost: CostModel, limit: float, fill_b: bool, fill_f: bool,
             warm: str) -> _Run | None:
    """Run, then rerun with the last run's idle times approved while the worst one falls (a
    rerun stops as soon as its worst idle time reaches the last one's: it would be dropped)."""
    best = _attempt(p, m, cost, limit, fill_b, fill_f, warm, None)
    for _ in range(REFINE):
        if best is None:
            return None
        if best.worst <= EPS:  # no rerun can idle less
            return best
        nxt = _attempt(p, m, cost, limit, fill_b, fill_f, warm, best.idle, best.worst - EPS)
        if nxt is None or max(nxt.idle) >= max(best.idle) - EPS:
            return best
        best = nxt
    return best


@remembered
def v_adaptive(p: int, m: int, cost: CostModel | None = None, *,
               mem_limit: float | None = None) -> Schedule:
    """Adaptive V under ``mem_limit`` per rank (cost-model ``act`` units; default 1F1B's
    p M_B); InfeasibleError when no variant fits (below about p/2 M_B, or m < 2). Module docstring
    for the construction."""
    if not isinstance(p, int) or isinstance(p, bool) or p < 1:
        raise ConfigError(f"p must be a positive integer, got {p!r}")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ConfigError(f"m (micro-batches) must be a positive integer, got {m!r}")
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    cost.check_fits(placement.num_stages, p)
    if mem_limit is None:
        mem_limit = p * max(cost.stage(i).act + cost.stage(2 * p - 1 - i).act for i in range(p))
    full = mem_limit >= p * max(cost.stage(i).act + cost.stage(2 * p - 1 - i).act
                                for i in range(p)) - EPS
    warm_ups = WARM_UPS[:2] if full else WARM_UPS  # with 1F1B's memory "target" is "m"
    best: _Run | None = None
    for fill_b, fill_f, warm in product((True, False), (True, False), warm_ups):
        run = _refined(p, m, cost, mem_limit, fill_b, fill_f, warm)
        if run is not None and (best is None or max(run.spans()) < max(best.spans()) - EPS):
            best = run
    if best is None:
        raise InfeasibleError(f"adaptive V: no schedule fits {mem_limit:g} per rank (p={p}, m={m})")
    return Schedule.build(best.orders, placement, m, name="v-adaptive")
