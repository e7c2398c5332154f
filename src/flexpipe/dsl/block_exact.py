"""Exact building blocks: the offsets of one micro-batch's passes chosen by OR-Tools CP-SAT so
that every rank's passes tile the interval T (its work per micro-batch) with no overlap modulo T,
under a per-rank bound on sum_s ceil(l_s / T) m_s (the controllable-memory paper's peak bound).

The greedy packer (``dsl.block.greedy_block``) places passes one by one and, when F, B and W
take different times, leaves fragments too short for the remaining passes, so T has to be
stretched and a bubble repeats every micro-batch. Solving the packing jointly keeps T equal to
the work, so the steady phase has no idle time at all (docs/facts.md: V-Half at T_F=1, T_B=1.5,
T_W=0.8). The solver runs single-threaded with a deterministic time limit, so the same input
always gives the same block.
"""

from __future__ import annotations

import math
from typing import Any

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import Block, stage_transfer
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement

RESOLUTION = 40  # time steps per cost-model unit
MEM_STEPS = 1000  # memory steps per cost-model unit
CACHE_SIZE = 256  # solved inputs kept; the oldest is dropped first
_CACHE: dict[str, Block | None] = {}


def exact_block(placement: Placement, cost: CostModel, mem_limit: float, *,
                graph: StageGraph | None = None, effort: float = 3.0) -> Block | None:
    """The block whose passes tile T with the fewest memory intervals (then the earliest W
    passes), with every rank's bound sum ceil(l_s/T) act_s <= ``mem_limit``; None when CP-SAT
    is unavailable or finds none within ``effort`` deterministic seconds. The last
    ``CACHE_SIZE`` inputs are cached (a search may try thousands of cost models)."""
    g = graph or StageGraph.chain(placement.num_stages)
    key = repr((placement, g, cost, mem_limit, effort))
    if key not in _CACHE:
        if len(_CACHE) >= CACHE_SIZE:
            del _CACHE[next(iter(_CACHE))]
        _CACHE[key] = _solve(placement, cost, mem_limit, g, effort)
    return _CACHE[key]


def _solve(placement: Placement, cost: CostModel, mem_limit: float, g: StageGraph,
           effort: float) -> Block | None:
    try:
        from ortools.sat.python import cp_model
    except ModuleNotFoundError:
        return None
    model = _Packing(cp_model, placement, cost, g)
    model.memory(mem_limit)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_deterministic_time = effort
    if solver.Solve(model.m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    offsets = {Op(k, s, 0): solver.Value(v) / RESOLUTION for (k, s), v in model.start.items()}
    durations = {Op(k, s, 0): cost.stage(s).time(k) for k, s in model.start}
    return Block(placement, offsets, durations, model.T / RESOLUTION, g)


class _Packing:
    """The CP-SAT model: start times, dependencies, per-rank modular no-overlap, lifespans."""

    def __init__(self, cp: Any, placement: Placement, cost: CostModel, g: StageGraph) -> None:
        self.cp, self.pl, self.cost, self.g, self.m = cp, placement, cost, g, cp.CpModel()
        S = placement.num_stages
        self.dur = {(k, s): _steps(cost.stage(s).time(k)) for k in "FBW" for s in range(S)}
        self.T = max(sum(self.dur[(k, s)] for s in placement.rank_stages[r] for k in "FBW")
                     for r in range(placement.num_ranks))
        self.cycles_max = 2 * S + 8
        horizon = self.T * self.cycles_max
        self.start = {o: self.m.NewIntVar(0, horizon, f"{o[0]}{o[1]}") for o in self.dur}
        self._dependencies()
        for r in range(placement.num_ranks):
            self._no_overlap(r)

    def _end(self, o: tuple[str, int]) -> Any:
        return self.start[o] + self.dur[o]

    def _comm(self, a: int, b: int, producer: int) -> int:
        return _steps(stage_transfer(self.cost, self.pl, a, b, producer))

    def _dependencies(self) -> None:
        add, g = self.m.Add, self.g
        for s in range(self.pl.num_stages):
            for q in g.preds[s]:
                add(self.start[("F", s)] >= self._end(("F", q)) + self._comm(q, s, q))
            for q in g.succs[s]:
                add(self.start[("B", s)] >= self._end(("B", q)) + self._comm(q, s, s))
            add(self.start[("B", s)] >= self._end(("F", s)))
            add(self.start[("W", s)] >= self._end(("B", s)))
            for k in "FBW":  # a gang's collective passes start together
                for t in g.peers(s, k):
                    if t > s:
                        add(self.start[(k, s)] == self.start[(k, t)])
        for s in g.sources()[:1]:
            add(self.start[("F", s)] == 0)

    def _no_overlap(self, r: int) -> None:
        """Each pass sits at position pos in [0, T) of its cycle; a second copy at pos + T makes
        collisions across the cycle boundary visible to one NoOverlap over [0, 2T)."""
        intervals = []
        for s in self.pl.rank_stages[r]:
            for k in "FBW":
                o, d = (k, s), self.dur[(k, s)]
                cycle = self.m.NewIntVar(0, self.cycles_max, "")
                pos = self.m.NewIntVar(0, self.T - 1, "")
                self.m.Add(self.start[o] == cycle * self.T + pos)
                intervals.append(self.m.NewFixedSizeIntervalVar(pos, d, ""))
                intervals.append(self.m.NewFixedSizeIntervalVar(pos + self.T, d, ""))
        self.m.AddNoOverlap(intervals)

    def memory(self, limit: float) -> None:
        """Per rank sum ceil(l_s / T) act_s <= limit; minimise the intervals held, then the
        W start times (shorter lifespans)."""
        held = {}
        for s in range(self.pl.num_stages):
            n = self.m.NewIntVar(1, self.cycles_max, f"n{s}")
            self.m.Add(self._end(("W", s)) - self.start[("F", s)] <= n * self.T)
            held[s] = n
        for r in range(self.pl.num_ranks):
            acts = [(held[s], round(self.cost.stage(s).act * MEM_STEPS))
                    for s in self.pl.rank_stages[r]]
            self.m.Add(sum(n * a for n, a in acts) <= math.floor(limit * MEM_STEPS + 1e-6))
        w_starts = sum(self.start[("W", s)] for s in range(self.pl.num_stages))
        weight = self.T * self.cycles_max * self.pl.num_stages + 1
        self.m.Minimize(sum(held.values()) * weight + w_starts)


def _steps(t: float) -> int:
    """Time in solver steps, rounded up so the real passes never overlap."""
    return math.ceil(t * RESOLUTION - 1e-9)
