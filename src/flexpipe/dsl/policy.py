"""Policy DSL: say what a rank prefers and what limits it keeps; a list scheduler driven by the
cost model turns that into a per-rank order.

At each moment a rank is free, its candidate passes are the next forward of each of its stages
(micro-batches in order), the next backward whose inputs have arrived, and any pending weight
gradient. Among those ready now and allowed by the limits, the policy's ``prefer`` order picks
(ties: lowest micro-batch, then deepest stage). A forward that starts a micro-batch on a rank
reserves memory for every later stage of that micro-batch on the same rank, so memory limits can
never deadlock V-shape or interleaved placements.

Stage graphs are followed as they are (forks, joins); a pass of a gang stage (``StageGraph.gangs``)
is chosen for all of its gang at once: it is ready when every member's inputs are in and every
member's rank is free, allowed when every member's rank allows it, and committed on every
member's rank at the same start time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from flexpipe.cost.model import CostModel, StageCost
from flexpipe.dsl.cutoff import Cutoff, CutoffReached, CutoffTracker
from flexpipe.dsl.remember import RUNS, Orders, run_key
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

PerRank = int | float | Sequence[float] | Callable[[int], float] | None


@dataclass(frozen=True)
class Policy:
    """What each rank prefers and what it may not exceed.

    ``prefer``: kind preference when several passes are ready ("B" also stands for BW).
    ``split``: backward as B + W (True) or fused BW (False).
    ``max_inflight``: micro-batch-stages begun (F started) and not yet released (W/BW ended),
    per rank: a number, a list, or a function of the rank.
    ``mem_limit``: activation memory per rank in cost-model units (same forms).
    ``defer_w``: run W only when no F or B can run (W fills idle time).
    ``priority``: optional key of an op (smaller runs first) replacing the kind preference; the
    building-block mode passes each op's block time here to squeeze and reorder a repetition.
    ``reserve``: memory kept back for the later stages (on the same rank) of micro-batches
    already begun: "one" keeps room for the largest single micro-batch need (enough to always
    progress), "all" for every begun micro-batch (never exceeds the limit mid-flight either),
    "none" checks only the memory actually held (tightest; may corner itself), "auto" tries
    "none" and falls back to "all".
    ``max_ahead``: micro-batches begun on a rank (F of its first stage there) and not yet
    backwarded through it (B or BW of that stage) -- the warm-up depth of 1F1B-like schedules
    (p - r for 1F1B and ZB-H1, 2(p - r) - 1 for ZB-H2); same forms as ``max_inflight``.
    ``gang_wait``: a collective pass of a gang may be chosen as soon as every member's inputs
    are in; it starts when the last member's rank is free (the others wait for it). False: it is
    chosen only once every member's rank is free at the same moment, so free ranks take other
    work first -- which can postpone the collective again and again.
    """

    prefer: tuple[str, ...] = ("B", "F", "W")
    split: bool = True
    max_inflight: PerRank = None
    mem_limit: PerRank = None
    defer_w: bool = True
    priority: Callable[[Op], float] | None = None
    reserve: str = "all"
    max_ahead: PerRank = None
    gang_wait: bool = True
    extra: dict[str, object] = field(default_factory=dict, compare=False)


def _per_rank(value: PerRank, r: int) -> float:
    table: dict[type, Callable[[], float]] = {
        type(None): lambda: float("inf"),
        int: lambda: float(value),  # type: ignore[arg-type]
        float: lambda: float(value),  # type: ignore[arg-type]
    }
    if type(value) in table:
        return table[type(value)]()
    if callable(value):
        return float(value(r))
    return float(value[r])  # type: ignore[index]


@dataclass
class _Rank:
    """Mutable list-scheduler state of one rank."""

    stages: tuple[int, ...]
    free: float = 0.0
    next_f: dict[int, int] = field(default_factory=dict)
    next_b: dict[int, int] = field(default_factory=dict)
    pending_w: list[Op] = field(default_factory=list)
    order: list[Op] = field(default_factory=list)
    inflight: int = 0
    ahead: int = 0
    mem: float = 0.0
    reserved: dict[tuple[int, int], float] = field(default_factory=dict)


class ListScheduler:
    """Greedy list scheduling of one placement under one policy and cost model."""

    def __init__(self, placement: Placement, m: int, cost: CostModel, policy: Policy,
                 graph: StageGraph | None = None, cutoff: Cutoff | None = None) -> None:
        self.pl, self.m, self.cost, self.policy = placement, m, cost, policy
        self.cutoff = cutoff
        self.graph = graph or StageGraph.chain(placement.num_stages)
        cost.check_fits(placement.num_stages, placement.num_ranks)
        self.end: dict[Op, float] = {}
        self.bw = "B" if policy.split else "BW"
        self.rank_of = placement.stage_rank
        self.later = {s: self._later_on_rank(s) for s in range(placement.num_stages)}
        self.first = {s: max((t for t in self.later if s in self.later[t]),
                             key=lambda t: (len(self.later[t]), -t))
                      for s in range(placement.num_stages)}
        self.limits = [(_per_rank(policy.max_inflight, r), _per_rank(policy.mem_limit, r))
                       for r in range(placement.num_ranks)]
        self.ahead_limit = [_per_rank(policy.max_ahead, r) for r in range(placement.num_ranks)]
        self.wake = self._neighbour_ranks()
        self.templates = self._templates()
        self.act = [cost.stage(s).act for s in range(placement.num_stages)]
        self.need = {s: sum(self.act[t] for t in self.later[s]) for s in self.later}
        self.apply: dict[str, Callable[[_Rank, Op, StageCost], None]] = {
            "F": self._on_f, "B": self._on_b, "BW": self._on_bw, "W": self._on_w}
        kinds = ["BW" if k == "B" and not policy.split else k for k in policy.prefer]
        self.rank_kind = {k: i for i, k in enumerate(kinds)}
        self.states: list[_Rank] = []
        self.ganged = {(k, s): g for s in range(placement.num_stages) for k in ("F", "B", "BW", "W")
                       if len(g := self.graph.members(s, k)) > 1}

    def _later_on_rank(self, s: int) -> tuple[int, ...]:
        """Stages reachable from s (s included) that sit on the same rank as s."""
        seen, todo, r = {s}, [s], self.pl.stage_rank[s]
        while todo:
            for t in self.graph.succs[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return tuple(sorted(t for t in seen if self.pl.stage_rank[t] == r))

    def run(self) -> list[list[Op]]:
        """Per-rank orders."""
        ranks = [_Rank(self.pl.rank_stages[r]) for r in range(self.pl.num_ranks)]
        for st in ranks:
            st.next_f = {s: 0 for s in st.stages}
            st.next_b = {s: 0 for s in st.stages}
        self.states = ranks
        per_mb = 3 if self.policy.split else 2
        total = len(self.end) + sum(len(s.stages) for s in ranks) * self.m * per_mb
        heap = [(0.0, r) for r in range(len(ranks))]
        track = None if self.cutoff is None else CutoffTracker(self.cutoff, self._work(ranks))
        done = 0
        while heap:
            t, r = heapq.heappop(heap)
            st = ranks[r]
            if t < st.free:
                continue
            op, start = self._choose(r, st, t)
            if op is None:
                if start is not None:
                    heapq.heappush(heap, (start, r))
                continue
            gang = self._gang(op)
            start = max(t, *(ranks[self.rank_of[g.stage]].free for g in gang))
            for member in gang:
                q = self.rank_of[member.stage]
                self._commit(q, ranks[q], member, start)
                if track is not None:
                    track.placed(q, start, ranks[q].free, self.end[member] - start)
                done += 1
                heapq.heappush(heap, (ranks[q].free, q))
                for w, delay in self.wake[member.stage]:
                    heapq.heappush(heap, (ranks[q].free + delay, w))
        if done != total:
            raise InfeasibleError(self._stuck_reason(ranks))
        return [st.order for st in ranks]

    def _work(self, ranks: list[_Rank]) -> list[float]:
        """Per rank, the time of every pass it will run."""
        kinds = ("F", "B", "W") if self.policy.split else ("F", "BW")
        return [self.m * sum(self.cost.stage(s).time(k) for s in st.stages for k in kinds)
                for st in ranks]

    def _neighbour_ranks(self) -> dict[int, tuple[tuple[int, float], ...]]:
        """Per stage, the other ranks whose passes may wait on it (its producers' and consumers'
        ranks): only they need waking when one of its passes ends, each after the link's
        latency from the stage's rank."""
        out = {}
        for s in range(self.pl.num_stages):
            q = self.rank_of[s]
            near = {self.rank_of[t] for t in (*self.graph.preds[s], *self.graph.succs[s])}
            out[s] = tuple((w, self.cost.comm.time(q, w, 0.0)) for w in sorted(near - {q}))
        return out

    def _gang(self, op: Op) -> list[Op]:
        """``op`` and the passes that run with it on the other stages of its gang."""
        gang = self.ganged.get((op.kind, op.stage))
        return [Op(op.kind, s, op.mb) for s in gang] if gang else [op]

    def _ready(self, op: Op, r: int) -> float | None:
        """When op can start: its inputs are on rank r (for a gang pass: every member's inputs
        on its rank, and -- unless ``gang_wait`` -- every member's rank free), or None while
        some input is not computed."""
        if not self.ganged or (op.kind, op.stage) not in self.ganged:
            return self._inputs(op)
        t = 0.0
        for member in self._gang(op):
            ready = self._inputs(member)
            if ready is None:
                return None
            free = 0.0 if self.policy.gang_wait else self.states[self.rank_of[member.stage]].free
            t = max(t, ready, free)
        return t

    def _inputs(self, op: Op) -> float | None:
        """When op's inputs are on its rank, or None while some input is not computed yet."""
        t, end, mb = 0.0, self.end, op.mb
        for kind, stage, delay in self.templates[(op.kind, op.stage)]:
            e = end.get((kind, stage, mb))  # type: ignore[call-overload]
            if e is None:
                return None
            t = max(t, e + delay)
        return t

    def _templates(self) -> dict[tuple[str, int], tuple[tuple[str, int, float], ...]]:
        """Per (kind, stage): the passes it needs (kind, stage) and the transfer delay of each
        to the op's rank, computed once."""
        out = {}
        for op in (Op(k, s, 0) for k in ("F", "B", "BW", "W") for s in range(self.pl.num_stages)):
            r, deps = self.rank_of[op.stage], []
            for d in self._needs(op):
                src, delay = self.rank_of[d.stage], 0.0
                if src != r:
                    nbytes = self.cost.hop(d.stage, op.stage,
                                           d.stage in self.graph.preds[op.stage])
                    delay = self.cost.comm.time(src, r, nbytes)
                deps.append((d.kind, d.stage, delay))
            out[(op.kind, op.stage)] = tuple(deps)
        return out

    def _needs(self, op: Op) -> list[Op]:
        g = self.graph
        table = {
            "F": lambda: [Op("F", s, op.mb) for s in g.preds[op.stage]],
            "B": lambda: [Op("F", op.stage, op.mb)]
            + [Op(self.bw, s, op.mb) for s in g.succs[op.stage]],
            "W": lambda: [Op("B", op.stage, op.mb)],
        }
        table["BW"] = table["B"]
        return table[op.kind]()

    def _candidates(self, st: _Rank) -> list[Op]:
        out = [Op("F", s, j) for s, j in st.next_f.items() if j < self.m]
        out += [Op(self.bw, s, j) for s, j in st.next_b.items() if j < st.next_f[s]]
        return out + st.pending_w[:1] if self.policy.defer_w else out + st.pending_w

    def _gang_allowed(self, op: Op) -> bool:
        """Whether the rank of every member of ``op``'s gang allows its pass."""
        if op.kind != "F":
            return True
        if not self.ganged or (op.kind, op.stage) not in self.ganged:
            return self._allowed(self.rank_of[op.stage], self.states[self.rank_of[op.stage]], op)
        return all(self._allowed(self.rank_of[m.stage], self.states[self.rank_of[m.stage]], m)
                   for m in self._gang(op))

    def _allowed(self, r: int, st: _Rank, op: Op) -> bool:
        if op.kind != "F":
            return True
        starts = op.stage == self.first[op.stage]
        if starts and st.ahead + 1 > self.ahead_limit[r]:
            return False
        max_inflight, mem_limit = self.limits[r]
        if self.policy.reserve == "none":
            return (st.inflight + 1 <= max_inflight
                    and st.mem + self.act[op.stage] <= mem_limit + 1e-9)
        if op.stage != self.first[op.stage]:
            return True
        need = self.need[op.stage]
        if self.policy.reserve == "all":
            held = sum(st.reserved.values())
        elif self.policy.reserve == "one":
            held = max(st.reserved.values(), default=0.0)
        else:
            raise ConfigError(f"unknown reserve mode {self.policy.reserve!r} "
                              "(all, one, none, auto)")
        return (st.inflight + len(self.later[op.stage]) <= max_inflight
                and st.mem + held + need <= mem_limit + 1e-9)

    def _choose(self, r: int, st: _Rank, t: float) -> tuple[Op | None, float | None]:
        best, best_key, soonest = None, None, None
        for op in self._candidates(st):
            ready = self._ready(op, r)
            if ready is None or not self._gang_allowed(op):
                continue
            if ready > t:
                soonest = ready if soonest is None else min(soonest, ready)
                continue
            key = self._key(op, st)
            if best_key is None or key < best_key:
                best, best_key = op, key
        return best, soonest

    def _key(self, op: Op, st: _Rank) -> tuple[float, ...]:
        if self.policy.priority is not None:
            return (self.policy.priority(op), op.mb, -op.stage)
        return (self._kind_rank(op, st), op.mb, -op.stage)

    def _kind_rank(self, op: Op, st: _Rank) -> int:
        if op.kind == "W" and self.policy.defer_w:
            return len(self.rank_kind) + 1
        return self.rank_kind.get(op.kind, len(self.rank_kind))

    def _commit(self, r: int, st: _Rank, op: Op, t: float) -> None:
        c = self.cost.stage(op.stage)
        dur = c.time(op.kind)
        self.end[op] = t + dur
        st.free = t + dur
        st.order.append(op)
        self.apply[op.kind](st, op, c)

    def _on_f(self, st: _Rank, op: Op, c: StageCost) -> None:
        act = c.act
        st.next_f[op.stage] += 1
        st.inflight += 1
        st.ahead += op.stage == self.first[op.stage]
        first = self.first[op.stage]
        if op.stage == first:
            for s in self.later[first]:
                st.reserved[(op.mb, s)] = self.cost.stage(s).act
        st.reserved.pop((op.mb, op.stage), None)
        st.mem += act

    def _on_b(self, st: _Rank, op: Op, c: StageCost) -> None:
        act, wact = c.act, c.wact
        st.next_b[op.stage] += 1
        st.ahead -= op.stage == self.first[op.stage]
        st.mem += wact - act
        st.pending_w.append(Op("W", op.stage, op.mb))

    def _on_bw(self, st: _Rank, op: Op, c: StageCost) -> None:
        st.next_b[op.stage] += 1
        st.ahead -= op.stage == self.first[op.stage]
        st.mem -= c.act
        st.inflight -= 1

    def _on_w(self, st: _Rank, op: Op, c: StageCost) -> None:
        st.pending_w.remove(op)
        st.mem -= c.wact
        st.inflight -= 1

    def _stuck_reason(self, ranks: list[_Rank]) -> str:
        parts = []
        for r, st in enumerate(ranks):
            left = sum(self.m - j for j in st.next_f.values())
            if left or st.pending_w or any(j < self.m for j in st.next_b.values()):
                parts.append(f"rank {r} stuck with {left} forwards left (memory {st.mem:g}, "
                             f"limit {self.limits[r][1]:g}, in flight {st.inflight})")
        return "policy cannot finish: " + "; ".join(parts)


def policy_schedule(placement: Placement, m: int, policy: Policy, cost: CostModel | None = None,
                    graph: StageGraph | None = None, name: str = "",
                    cutoff: Cutoff | None = None) -> Schedule:
    """Run the list scheduler; ``cost`` defaults to unit costs per rank split over its stages.
    ``cutoff``: stop with ``CutoffReached`` once the schedule provably ends no better
    (``dsl.cutoff``). Runs are remembered (``dsl.remember``): the search and the library ask
    for the same one several times."""
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ConfigError(f"m (micro-batches) must be a positive integer, got {m!r}")
    cost = cost or CostModel.per_rank(placement.stage_rank, placement.num_ranks)
    if policy.reserve == "auto":  # unreserved is tighter but can corner itself: then reserve
        try:  # also when cut off: "none" might have cornered itself later
            orders = _orders(placement, m, cost, replace(policy, reserve="none"), graph, cutoff)
        except InfeasibleError:
            orders = _orders(placement, m, cost, replace(policy, reserve="all"), graph, cutoff)
    else:
        orders = _orders(placement, m, cost, policy, graph, cutoff)
    return Schedule.build(orders, placement, m, graph, name)


def _orders(placement: Placement, m: int, cost: CostModel, policy: Policy,
            graph: StageGraph | None, cutoff: Cutoff | None) -> Orders:
    """One list-scheduler run, remembered (with its InfeasibleError) when its inputs are
    values; a run stopped by ``cutoff`` is not remembered."""
    key = run_key(placement, m, cost, policy, graph)
    found = RUNS.get(key)
    if found is not None:
        return found
    try:
        orders = tuple(map(tuple, ListScheduler(placement, m, cost, policy, graph, cutoff).run()))
    except CutoffReached:
        raise
    except InfeasibleError as exc:
        RUNS.put(key, exc, cost)
        raise
    RUNS.put(key, orders, cost)
    return orders
