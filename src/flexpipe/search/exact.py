"""Exact schedule optimisation with OR-Tools CP-SAT.

One interval variable per pass (F, B, W or BW of each stage and micro-batch); a NoOverlap per rank
(its compute stream); precedences with the transfer time between ranks; a reservoir per rank for
activation memory (F adds ``act`` at its start, B turns it into ``wact`` at its end, W frees
``wact``, BW frees ``act``) capped at the rank's limit; micro-batches keep their order per stage
and kind (symmetry breaking). The objective is the largest per-rank span (first pass start to
last pass end), the bubble rate's ``cost``. Times are scaled to integers (rounded; the returned
schedule is re-timed by the simulator, which is the authority).

For larger instances ``improve`` keeps the heuristic's per-rank order outside a time window and
lets CP-SAT reorder the passes inside it (warm-started from the heuristic), window by window.

Any stage graph: precedences follow its edges (F after each producer's F, B after each consumer's
B), and the passes of a gang (same kind and micro-batch on each of its stages) share one start.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flexpipe.cost.model import Comm, CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.lower import receive_for, send_after, transfer_stages
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.engine import simulate

FULL_OPS = 400  # solve the whole model up to this many passes; windows beyond
WINDOW_OPS = 150  # passes free to move in one window (about)
MEM_SCALE = 1000


@dataclass
class ExactReport:
    """Outcome of one CP-SAT run: solver ``status`` (OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, or
    "unavailable" without OR-Tools), the schedule found, its objective and the solver's proven
    lower bound (both in cost-model time units), and the windows solved."""

    status: str
    schedule: Schedule | None
    objective: float | None = None
    bound: float | None = None
    seconds: float = 0.0
    windows: tuple[tuple[float, float], ...] = ()

    placement: str = ""
    split: bool = True

    @property
    def claim(self) -> str:
        """What the run proves, in words (``--exact`` prints it)."""
        scope = (f"for the {self.placement or 'given'} placement, "
                 f"{'split B/W' if self.split else 'fused BW'} backward, this memory limit, "
                 "micro-batches in order per stage; other placements and split modes were not "
                 "searched")
        if self.windows:
            return ("improved inside time windows only (the order outside them kept): no "
                    "optimality claim")
        if self.status == "OPTIMAL":
            return f"proven optimal {scope}"
        if self.status == "FEASIBLE":
            return (f"best found within the time limit, not proven optimal (solver lower bound "
                    f"{self.bound:.6g}) {scope}")
        return f"no schedule found ({self.status}) {scope}"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready dictionary (the schedule as text)."""
        return {"status": self.status, "objective": self.objective, "bound": self.bound,
                "seconds": self.seconds, "windows": [list(w) for w in self.windows],
                "claim": self.claim,
                "schedule": self.schedule.to_text() if self.schedule else None}


def _cp() -> Any:
    try:
        from ortools.sat.python import cp_model
    except ModuleNotFoundError:
        return None
    return cp_model


def _scale(cost: CostModel) -> float:
    """Integer time scale: the shortest positive time becomes at least 100 units, the longest
    at most 10,000 (relative rounding error below 1%)."""
    times = [v for st in cost.stages for v in st.times.values() if v > 0]
    times += [v for row in cost.comm.latency for v in row if v > 0]
    if not times:
        return 1.0
    return min(100.0 / min(times), 10_000.0 / max(times))


def integer_cost(cost: CostModel, k: float) -> CostModel:
    """``cost`` in integer time units of 1/k: times rounded, each link's latency plus the
    largest boundary transfer rounded up (bandwidth folded into the latency)."""
    stages = tuple(replace(st.map_times(lambda v: float(round(v * k))), out_bytes=0.0)
                   for st in cost.stages)
    nbytes = max(st.out_bytes for st in cost.stages)
    n = cost.comm.num_ranks
    lat = tuple(tuple(float(math.ceil(cost.comm.time(a, b, nbytes) * k - 1e-9)) if a != b
                      else 0.0 for b in range(n)) for a in range(n))
    inf = tuple(tuple(math.inf for _ in range(n)) for _ in range(n))
    return CostModel(stages, Comm(lat, inf, float(round(cost.comm.post * k))))


class _Model:
    """The CP-SAT model of one placement, m micro-batches, a cost model and per-rank limits."""

    def __init__(self, placement: Placement, m: int, cost: CostModel,
                 limits: Sequence[float], split: bool, horizon: float,
                 graph: StageGraph | None = None) -> None:
        self.cp = _cp()
        self.pl, self.m, self.split = placement, m, split
        self.graph = graph or StageGraph.chain(placement.num_stages)
        self.topo = {s: i for i, s in enumerate(self.graph.topological())}
        self.k = _scale(cost)
        self.cost = cost = integer_cost(cost, self.k)
        self.model = self.cp.CpModel()
        self.back = "B" if split else "BW"
        kinds = ("F", "B", "W") if split else ("F", "BW")
        self.ops = [Op(k, s, j) for s in range(placement.num_stages) for j in range(m)
                    for k in kinds]
        self.where = transfer_stages(self.graph, placement.stage_rank)
        self.dur = {op: int(cost.stage(op.stage).time(op.kind)) + self._posts(op)
                    for op in self.ops}
        H = int(math.ceil(horizon * self.k))
        self.start = {op: self.model.NewIntVar(0, H, str(op)) for op in self.ops}
        self.end = {op: self.start[op] + self.dur[op] for op in self.ops}
        self._no_overlap()
        self._precedences()
        self._memory(limits)
        self.span = self._objective(H)

    def _posts(self, op: Op) -> int:
        """The compute thread's posting time around ``op`` (``Comm.post`` per receive before
        it and per send after it, as the simulator charges it), in the pass's duration."""
        if not self.cost.comm.post:
            return 0
        count = ((receive_for(op, self.where) is not None)
                 + (send_after(op, self.where) is not None))
        return int(self.cost.comm.post) * count

    def _no_overlap(self) -> None:
        for r in range(self.pl.num_ranks):
            stages = set(self.pl.rank_stages[r])
            self.model.AddNoOverlap([
                self.model.NewFixedSizeIntervalVar(self.start[op], self.dur[op], f"i{op}")
                for op in self.ops if op.stage in stages])

    def _delay(self, a: int, b: int) -> int:
        ra, rb = self.pl.stage_rank[a], self.pl.stage_rank[b]
        if ra == rb:
            return 0
        return int(self.cost.comm.time(ra, rb, 0.0))

    def _precedences(self) -> None:
        add, back, g = self.model.Add, self.back, self.graph
        for op in self.ops:
            s, j, st = op.stage, op.mb, self.start[op]
            if op.kind == "F":
                for a in g.preds[s]:
                    add(st >= self.end[Op("F", a, j)] + self._delay(a, s))
            if op.kind == back:
                add(st >= self.end[Op("F", s, j)])
                for c in g.succs[s]:
                    add(st >= self.end[Op(back, c, j)] + self._delay(c, s))
            if op.kind == "W":
                add(st >= self.end[Op("B", s, j)])
            if j > 0:  # micro-batches in order per stage and kind
                add(st >= self.end[Op(op.kind, s, j - 1)])
            for t in g.peers(s, op.kind):  # a gang's collective passes start together
                if t > s:
                    add(st == self.start[Op(op.kind, t, j)])

    def _memory(self, limits: Sequence[float]) -> None:
        for r in range(self.pl.num_ranks):
            times, deltas = [], []
            for s in self.pl.rank_stages[r]:
                c = self.cost.stage(s)
                act, wact = round(c.act * MEM_SCALE), round(c.wact * MEM_SCALE)
                for j in range(self.m):
                    events = [(self.start[Op("F", s, j)], act)]
                    if self.split:
                        events += [(self.end[Op("B", s, j)], wact - act),
                                   (self.end[Op("W", s, j)], -wact)]
                    else:
                        events.append((self.end[Op("BW", s, j)], -act))
                    for t, d in events:
                        times.append(t)
                        deltas.append(d)
            cap = int(math.floor(limits[r] * MEM_SCALE + 1e-6))
            self.model.AddReservoirConstraint(times, deltas, 0, cap)

    def _objective(self, H: int) -> Any:
        span = self.model.NewIntVar(0, H, "span")
        last = "W" if self.split else "BW"
        for r in range(self.pl.num_ranks):
            stages = self.pl.rank_stages[r]
            if not stages:
                continue
            first = self.model.NewIntVar(0, H, f"first{r}")
            self.model.AddMinEquality(first, [self.start[Op("F", s, 0)] for s in stages])
            for s in stages:
                self.model.Add(span >= self.end[Op(last, s, self.m - 1)] - first)
        self.model.Minimize(span)
        return span

    def hint(self, schedule: Schedule) -> Sequence[Sequence[float]]:
        """Warm start from a schedule timed in the model's integer units; returns the starts."""
        trace = simulate(schedule, self.cost)
        for r, ops in enumerate(schedule.ranks):
            for op, t in zip(ops, trace.starts[r], strict=True):
                if op in self.start:
                    self.model.AddHint(self.start[op], int(round(t)))
        self.model.AddHint(self.span, int(round(max(trace.metrics().span))))
        return trace.starts

    def fix_order_outside(self, schedule: Schedule, starts: Sequence[Sequence[float]],
                          window: tuple[float, float]) -> None:
        """Keep ``schedule``'s per-rank order for passes that start outside ``window``."""
        lo, hi = window[0] * self.k, window[1] * self.k
        for r, ops in enumerate(schedule.ranks):
            fixed = [op for op, t in zip(ops, starts[r], strict=True)
                     if op in self.start and not lo <= t <= hi]
            for a, b in zip(fixed, fixed[1:], strict=False):
                self.model.Add(self.start[b] >= self.end[a])

    def _order_key(self, solver: Any, op: Op) -> tuple[int, ...]:
        """Per-rank order of the solution: by start, then end (a pass that takes no time in the
        integer units goes before one it feeds that starts with it), then dependency order
        (F before B before W; forwards down the graph, backwards up it)."""
        start = solver.Value(self.start[op])
        pos = self.topo[op.stage]
        kind = {"F": 0, "B": 1, "BW": 1, "W": 2}[op.kind]
        return (start, start + self.dur[op], kind, pos if kind == 0 else -pos, op.mb)

    def solve(self, time_limit: float, workers: int) -> tuple[str, Schedule | None, float | None,
                                                               float | None]:
        solver = self.cp.CpSolver()
        solver.parameters.max_time_in_seconds = float(time_limit)
        solver.parameters.num_workers = workers
        code = solver.Solve(self.model)
        status = solver.StatusName(code)
        if status not in ("OPTIMAL", "FEASIBLE"):
            return status, None, None, None
        orders: list[list[tuple[tuple[int, ...], Op]]] = [[] for _ in range(self.pl.num_ranks)]
        for op in self.ops:
            orders[self.pl.stage_rank[op.stage]].append((self._order_key(solver, op), op))
        sched = Schedule.build([[op for _, op in sorted(row)] for row in orders], self.pl,
                               self.m, self.graph, name="exact")
        return (status, sched, solver.ObjectiveValue() / self.k,
                solver.BestObjectiveBound() / self.k)


def _split_of(schedule: Schedule) -> bool:
    kinds = schedule.kinds()
    if not kinds <= {"F", "B", "W", "BW"} or ("BW" in kinds and "B" in kinds):
        raise ConfigError(f"the exact optimiser handles F/B/W or F/BW schedules, not "
                          f"{', '.join(sorted(kinds))}")
    return "B" in kinds


def solve(placement: Placement, m: int, cost: CostModel, limits: Sequence[float], *,
          split: bool = True, time_limit: float = 10.0, hint: Schedule | None = None,
          window: tuple[float, float] | None = None, workers: int = 2,
          graph: StageGraph | None = None) -> ExactReport:
    """Optimise the whole schedule (or, with ``hint`` and ``window``, only the passes the hint
    starts inside the window) for the largest per-rank span under per-rank ``limits``, on
    ``graph`` (default: the hint's graph, else the chain)."""
    t0 = time.perf_counter()
    if _cp() is None:
        return ExactReport("unavailable", None, placement=placement.kind, split=split)
    k = _scale(cost)
    horizon = (simulate(hint, integer_cost(cost, k)).metrics().makespan / k if hint else
               sum(st.time(key) for st in cost.stages for key in ("F", "B", "W")) * m * 2)
    graph = graph or (hint.graph if hint is not None else None)
    model = _Model(placement, m, cost, limits, split, horizon, graph)
    if hint is not None:
        starts = model.hint(hint)
        if window is not None:
            model.fix_order_outside(hint, starts, window)
    status, sched, obj, bound = model.solve(time_limit, workers)
    windows = (window,) if window else ()
    return ExactReport(status, sched, obj, bound, time.perf_counter() - t0, windows,
                       placement.kind, split)


def improve(schedule: Schedule, cost: CostModel, limits: Sequence[float], *,
            time_limit: float = 10.0, workers: int = 2) -> ExactReport:
    """Improve ``schedule``: exactly when it has at most ``FULL_OPS`` passes, else by windows
    over its warm-up and cool-down (where the bubbles are), each warm-started from the last.
    A schedule the optimiser cannot model (offload, recompute, ...) is left as it is: the
    report's status says why and holds no schedule."""
    try:
        split = _split_of(schedule)
    except ConfigError as exc:
        return ExactReport(f"skipped: {exc}", None)
    if len(schedule) <= FULL_OPS:
        return solve(schedule.placement, schedule.microbatches, cost, limits, split=split,
                     time_limit=time_limit, hint=schedule, workers=workers)
    return _by_windows(schedule, cost, limits, split, time_limit, workers)


def _by_windows(schedule: Schedule, cost: CostModel, limits: Sequence[float], split: bool,
                time_limit: float, workers: int) -> ExactReport:
    t0 = time.perf_counter()
    makespan = simulate(schedule, cost).metrics().makespan
    width = makespan * min(0.3, WINDOW_OPS / len(schedule))
    windows = ((0.0, width), (makespan - width, makespan))
    best, reports = schedule, []
    for window in windows:
        rep = solve(schedule.placement, schedule.microbatches, cost, limits, split=split,
                    time_limit=time_limit / len(windows), hint=best, window=window,
                    workers=workers)
        reports.append(rep)
        if rep.schedule is not None and _span(rep.schedule, cost) < _span(best, cost) - 1e-9:
            best = rep.schedule
    status = "FEASIBLE" if any(r.schedule for r in reports) else reports[-1].status
    improved = best if best is not schedule else None
    return ExactReport(status, improved or schedule, _span(best, cost), None,
                       time.perf_counter() - t0, windows, schedule.placement.kind, split)


def _span(schedule: Schedule, cost: CostModel) -> float:
    return max(simulate(schedule, cost).metrics().span)
