"""The zero-bubble paper's cost-aware heuristic for the linear placement under a memory limit
(Qi et al., ICLR 2024, section 3.1; written from its description and its authors' scheduler's
behaviour). One stage per rank; the greedy times every pass as it places it (start = max(rank
free, input arrived + transfer), times and transfers from the cost model):

1. warm-up: one forward on every stage; then, from the last stage back, each stage takes as
   many extra forwards as fit its memory and end before the first backward can reach it (or,
   with ``bubble_first``, may overrun that moment by less than a forward), no stage more than
   the one before it; then the first backward down the pipeline.
2. one round per further micro-batch: each stage takes one forward (unless, with
   ``prefer_b``, it is two forwards ahead of the next stage and a forward would delay the
   backward coming back, or the wait is within the worst stage's idle time so far), no stage
   taking one when the next does not; then every stage, last first, takes its next backward.
   Before each pass, weight-gradient passes (W, oldest first) run when memory needs them, when
   they end before the pass's input arrives (they fill the bubble), or when waiting would idle
   this stage beyond the worst stage so far (always, or with ``greedy_w`` only then).
3. the remaining W passes.

Eight variants (``bubble_first`` x ``prefer_b`` x ``greedy_w``) are run and the one with the
smallest largest per-stage span is kept.
"""

from __future__ import annotations

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


@dataclass
class _Run:
    """One greedy pass over p stages and m micro-batches, and its mutable state."""

    p: int
    m: int
    cost: CostModel
    limit: float
    bubble_first: bool
    prefer_b: bool
    greedy_w: bool
    count: dict[tuple[str, int], int] = field(default_factory=dict)
    end: dict[Op, float] = field(default_factory=dict)
    free: list[float] = field(default_factory=list)
    mem: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    rows: list[list[Op]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free, self.mem, self.idle = [0.0] * self.p, [0.0] * self.p, [0.0] * self.p
        self.rows = [[] for _ in range(self.p)]
        pl = Placement.linear(self.p)
        self.comm = [stage_transfer(self.cost, pl, j, j + 1, j) for j in range(self.p - 1)]

    def n(self, kind: str, j: int) -> int:
        return self.count.get((kind, j), 0)

    def time(self, kind: str, j: int) -> float:
        return self.cost.stage(j).time(kind)

    def dmem(self, kind: str, j: int) -> float:
        st = self.cost.stage(j)
        return {"F": st.act, "B": st.wact - st.act, "W": -st.wact}[kind]

    def ready(self, kind: str, j: int) -> float:
        """When the input of stage j's next ``kind`` pass has arrived (0: nothing to wait for)."""
        i = self.n(kind, j)
        source = Op(kind, j - 1, i) if kind == "F" else Op(kind, j + 1, i)
        if not 0 <= source.stage < self.p:
            return 0.0
        if source not in self.end:
            raise InfeasibleError(f"zb greedy: stage {j}'s {kind}{i} comes before its input "
                                  f"{source} is placed")
        return self.end[source] + self.comm[min(j, source.stage)]

    def put(self, j: int, kind: str) -> None:
        i = self.n(kind, j)
        if i >= self.m:
            raise ConfigError(f"zb greedy: stage {j} has no {kind} pass left (internal)")
        start = max(self.free[j], self.ready(kind, j) if kind != "W" else 0.0)
        if self.n("F", j) > 0:
            self.idle[j] += start - self.free[j]
        op = Op(kind, j, i)
        self.end[op] = self.free[j] = start + self.time(kind, j)
        self.mem[j] += self.dmem(kind, j)
        self.rows[j].append(op)
        self.count[(kind, j)] = i + 1

    def w_left(self, j: int) -> bool:
        return self.n("W", j) < self.n("B", j)

    def make_room(self, j: int, kind: str) -> None:
        """W passes until stage j's next ``kind`` pass fits the memory limit."""
        while self.mem[j] + self.dmem(kind, j) > self.limit + EPS:
            if not self.w_left(j):
                raise InfeasibleError(f"zb greedy: stage {j} cannot fit a {kind} pass within "
                                      f"{self.limit:g}")
            self.put(j, "W")

    def fill(self, j: int, ready: float) -> None:
        """W passes that end before ``ready`` (filling the bubble), then one more when the
        wait would idle stage j beyond the worst stage (or always, without ``greedy_w``)."""
        while self.w_left(j) and self.free[j] + self.time("W", j) <= ready + EPS:
            self.put(j, "W")
        if self.w_left(j) and self.free[j] < ready - EPS:
            within = ready - self.free[j] <= max(self.idle) - self.idle[j] + EPS
            if self.greedy_w or not within:
                self.put(j, "W")

    def step(self, j: int, kind: str) -> None:
        """Stage j's next ``kind`` pass with its W passes before it."""
        self.make_room(j, kind)
        if (kind == "F" and j > 0) or (kind == "B" and j < self.p - 1):
            self.fill(j, self.ready(kind, j))
        self.put(j, kind)

    def warm_up(self) -> None:
        p = self.p
        for j in range(p):
            self.make_room(j, "F")
            self.put(j, "F")
        extra = [0] * p
        last = self.end[Op("F", p - 1, 0)] + self.time("B", p - 1)
        for j in range(p - 2, -1, -1):
            mem, t = self.mem[j], self.free[j]
            room = self.limit + EPS
            while self.n("F", j) + extra[j] < self.m and mem + self.dmem("F", j) <= room:
                arrive = last + self.comm[j]
                if (t + self.time("F", j) > arrive + EPS) if self.bubble_first else \
                        (t >= arrive - EPS):
                    break
                mem, t, extra[j] = mem + self.dmem("F", j), t + self.time("F", j), extra[j] + 1
            last = max(t, last + self.comm[j]) + self.time("B", j)
        for j in range(1, p):  # never more forwards than the stage before it has made
            extra[j] = max(0, min(extra[j], extra[j - 1] - 1))
        for j in range(p):
            for _ in range(extra[j]):
                self.put(j, "F")
        for j in range(p - 1, -1, -1):
            self.make_room(j, "B")
            self.put(j, "B")

    def wants_f(self, j: int) -> bool:
        """Whether stage j takes a forward this round."""
        if self.n("F", j) >= self.m:
            return False
        if not (self.prefer_b and j + 1 < self.p and self.n("F", j) >= self.n("F", j + 1) + 2):
            return True
        back = (self.free[j + 1] + self.time("F", j + 1) + self.time("B", j + 1)
                + self.comm[j])
        if self.free[j] >= back - EPS:
            return False
        mem, w_time, k = self.mem[j] + self.dmem("F", j), 0.0, 0
        while mem > self.limit + EPS and self.n("W", j) + k < self.n("B", j):
            mem, w_time, k = mem + self.dmem("W", j), w_time + self.time("W", j), k + 1
        if self.free[j] + self.time("F", j) + w_time <= back + EPS:
            return True
        return not back - self.free[j] <= max(self.idle) - self.idle[j] + EPS

    def steady(self) -> None:
        p = self.p
        for i in range(1, self.m):
            take = [self.wants_f(j) for j in range(p)]
            for j in range(p - 2, -1, -1):
                take[j] = take[j] and take[j + 1]
            for j in range(p):
                if take[j]:
                    self.step(j, "F")
            for j in range(p - 1, -1, -1):
                if self.n("B", j) != i:
                    raise InfeasibleError("zb greedy: a backward ran ahead of its round")
                if j == 0 and self.n("F", 0) == self.m:
                    while self.w_left(0):
                        self.put(0, "W")
                self.step(j, "B")

    def run(self) -> Schedule:
        self.warm_up()
        self.steady()
        for j in range(self.p):
            while self.n("W", j) < self.m:
                self.put(j, "W")
        return Schedule.build(self.rows, Placement.linear(self.p), self.m, name="zb-greedy")

    def span(self) -> float:
        return max(self.end[Op("W", j, self.m - 1)] - self.end[Op("F", j, 0)]
                   + self.time("F", j) for j in range(self.p))


@remembered
def zb_greedy(p: int, m: int, cost: CostModel | None = None,
              mem_limit: float | None = None) -> Schedule:
    """The zero-bubble paper's heuristic on the linear placement (module docstring): the best
    of its eight variants under ``mem_limit`` (per rank, in the cost model's memory units;
    default 2p M_B), by the largest per-stage span; InfeasibleError when none fits."""
    if not isinstance(p, int) or p < 1 or not isinstance(m, int) or m < 1:
        raise ConfigError(f"zb greedy needs positive integers p and m, got p={p!r}, m={m!r}")
    cost = cost or CostModel.uniform(p, p)
    if cost.num_stages != p:
        raise ConfigError(f"zb greedy: the cost model has {cost.num_stages} stages, not p={p}")
    limit = mem_limit if mem_limit is not None else 2 * p * max(
        cost.stage(j).act for j in range(p))
    best: tuple[float, Schedule] | None = None
    for bubble_first, prefer_b, greedy_w in product((True, False), repeat=3):
        run = _Run(p, m, cost, limit, bubble_first, prefer_b, greedy_w)
        try:
            sched = run.run()
        except InfeasibleError:
            continue
        if best is None or run.span() < best[0] - EPS:
            best = (run.span(), sched)
    if best is None:
        raise InfeasibleError(f"zb greedy: no variant fits {limit:g} per rank (p={p}, m={m})")
    return best[1]
