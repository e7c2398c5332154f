"""Building-block DSL (the controllable-memory framework of Qi et al. 2024).

A building block gives the start offset of every pass of ONE micro-batch; micro-batch j runs the
same block shifted by j*T. Each rank's order is its passes sorted by block time; the simulator
then squeezes the repetition (every op as early as its order and inputs allow). The block also
yields each stage's lifespan l_s (start of F to end of W/BW) and the peak-memory bound
sum_s ceil(l_s / T) * m_s per rank, which FlexPipe reports next to the simulated peak.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

EPS = 1e-9


@dataclass(frozen=True)
class Block:
    """Offsets of one micro-batch's passes (ops with mb 0), their durations, and the interval."""

    placement: Placement
    offsets: Mapping[Op, float]
    durations: Mapping[Op, float]
    interval: float
    graph: StageGraph | None = None

    def __post_init__(self) -> None:
        if not self.interval > 0:
            raise ConfigError(f"building block interval T must be positive, got {self.interval}")
        for r in range(self.placement.num_ranks):
            self._check_rank(r)

    def _check_rank(self, r: int) -> None:
        """Passes of one rank must not overlap each other modulo T."""
        spans = []
        for op, t in self.offsets.items():
            if self.placement.stage_rank[op.stage] == r and self.durations[op] > EPS:
                d = self.durations[op]
                if d > self.interval + EPS:
                    raise ConfigError(
                        f"pass {op} ({d:g}) is longer than the interval T={self.interval:g}")
                a = t % self.interval
                spans += [(a, a + d, op), (a - self.interval, a + d - self.interval, op)]
        spans.sort(key=lambda x: x[0])
        for (_a0, e0, o0), (a1, _e1, o1) in zip(spans, spans[1:], strict=False):
            if o0 != o1 and a1 < e0 - EPS:
                raise ConfigError(f"building block overlaps itself on rank {r}: {o0} and {o1} "
                                  f"collide modulo T={self.interval:g}")

    def lifespan(self, stage: int) -> float:
        """Start of the stage's F to the end of its last backward pass (W or BW)."""
        f = self.offsets[Op("F", stage, 0)]
        ends = [self.offsets[o] + self.durations[o] for o in self.offsets
                if o.stage == stage and o.kind in ("W", "BW", "B")]
        return max(ends) - f

    def memory_bound(self, cost: CostModel) -> list[float]:
        """Per rank: sum over its stages of ceil(l_s / T) * act_s (the paper's peak bound)."""
        out = [0.0] * self.placement.num_ranks
        for s, r in enumerate(self.placement.stage_rank):
            out[r] += math.ceil(self.lifespan(s) / self.interval - EPS) * cost.stage(s).act
        return out

    def schedule(self, m: int, name: str = "") -> Schedule:
        """Repeat the block for micro-batches 0..m-1 and order each rank by block time."""
        if not isinstance(m, int) or m < 1:
            raise ConfigError(f"m (micro-batches) must be a positive integer, got {m!r}")
        rows: list[list[tuple[float, int, Op]]] = [[] for _ in range(self.placement.num_ranks)]
        for op, t in self.offsets.items():
            r = self.placement.stage_rank[op.stage]
            for j in range(m):
                rows[r].append((t + j * self.interval, op.stage, Op(op.kind, op.stage, j)))
        orders = [[op for _, _, op in sorted(row)] for row in rows]
        return Schedule.build(orders, self.placement, m, self.graph, name)


def greedy_block(placement: Placement, cost: CostModel, interval: float, *,
                 f_gap: float | Sequence[float] = 0.0, b_gap: float | Sequence[float] = 0.0,
                 w_delay: float | Sequence[float] = 0.0, split: bool = True,
                 graph: StageGraph | None = None, max_shift: float | None = None) -> Block:
    """Build a block by placing passes in dependency order (all F down the stages, then the
    backward passes back up, then the W passes), each at the earliest time that is at least
    ``gap`` after its input is ready and does not collide modulo T with the rank's passes placed
    so far. Gaps may be per stage. W goes at least ``w_delay`` after its B (longer lifespans,
    more memory).
    ``max_shift`` bounds how far an F or B may slide past its earliest time to avoid a collision
    (lifespans stay tight; W may go anywhere after its B); past it an ``InfeasibleError`` says
    the interval is too short."""
    g = graph or StageGraph.chain(placement.num_stages)
    S = placement.num_stages
    gaps = {name: _per_stage(v, S, name) for name, v in
            (("f_gap", f_gap), ("b_gap", b_gap), ("w_delay", w_delay))}
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in range(placement.num_ranks)}
    offsets: dict[Op, float] = {}
    durations: dict[Op, float] = {}
    ends: dict[Op, float] = {}

    def place(op: Op, earliest: float) -> None:
        d = cost.stage(op.stage).time(op.kind)
        r = placement.stage_rank[op.stage]
        t = _first_free(busy[r], earliest, d, interval)
        if max_shift is not None and op.kind != "W" and t - earliest > max_shift + EPS:
            raise InfeasibleError(f"building block: {op} would slide {t - earliest:g} past its "
                              f"earliest start (max {max_shift:g}); T={interval:g} is too short")
        busy[r].append((t % interval, d))
        offsets[op], durations[op], ends[op] = t, d, t + d

    order = _topo(g)
    for s in order:
        ready = max((ends[Op("F", q, 0)] + stage_transfer(cost, placement, q, s, q)
                     for q in g.preds[s]), default=0.0)
        place(Op("F", s, 0), ready + (gaps["f_gap"][s] if g.preds[s] else 0.0))
    back = "B" if split else "BW"
    for s in reversed(order):
        ready = max([ends[Op("F", s, 0)]]
                    + [ends[Op(back, q, 0)] + stage_transfer(cost, placement, q, s, s)
                       for q in g.succs[s]])
        place(Op(back, s, 0), ready + (gaps["b_gap"][s] if g.succs[s] else 0.0))
    for s in reversed(order if split else []):
        place(Op("W", s, 0), ends[Op("B", s, 0)] + gaps["w_delay"][s])
    return Block(placement, offsets, durations, interval, graph)


def _per_stage(value: float | Sequence[float], n: int, name: str) -> list[float]:
    vals = [float(value)] * n if isinstance(value, int | float) else [float(v) for v in value]
    if len(vals) != n or any(v < 0 or v != v for v in vals):
        raise ConfigError(f"{name} must be a non-negative number or one per stage ({n})")
    return vals


def stage_transfer(cost: CostModel, placement: Placement, a: int, b: int, producer: int) -> float:
    """Transfer from stage a's rank to stage b's of the tensor on the edge out of ``producer``
    (the forward output, or its gradient going back)."""
    ra, rb = placement.stage_rank[a], placement.stage_rank[b]
    return cost.comm.time(ra, rb, cost.hop(a, b, producer == a)) if ra != rb else 0.0


def _first_free(busy: list[tuple[float, float]], earliest: float, d: float, T: float) -> float:
    """Earliest t >= earliest whose interval [t, t+d) mod T avoids every busy interval (a pass
    of no time fits anywhere)."""
    if d <= EPS:
        return earliest
    candidates = sorted({earliest} | {earliest + ((a + bd - earliest) % T) for a, bd in busy})
    for t in candidates:
        a = t % T
        if all(_disjoint(a, d, b, bd, T) for b, bd in busy):
            return t
    raise InfeasibleError(f"building block: no free slot of length {d:g} within T={T:g}")


def _disjoint(a: float, d: float, b: float, bd: float, T: float) -> bool:
    for shift in (-T, 0.0, T):
        if a < b + shift + bd - EPS and b + shift < a + d - EPS:
            return False
    return True


def _topo(g: StageGraph) -> list[int]:
    indeg = [len(p) for p in g.preds]
    ready = [s for s in range(g.num_stages) if indeg[s] == 0]
    out = []
    while ready:
        s = min(ready)
        ready.remove(s)
        out.append(s)
        for t in g.succs[s]:
            indeg[t] -= 1
            if indeg[t] == 0:
                ready.append(t)
    return out
