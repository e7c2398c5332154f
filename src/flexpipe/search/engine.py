"""``search``: the automated scheduler. Walks the space (``flexpipe.search.space``) in order,
prunes each candidate by analytic bounds before building it (memory closed forms, the makespan
lower bound against the incumbent), simulates the rest, keeps the fastest that fits every
rank's memory limit, and optionally improves it with the exact CP-SAT optimiser."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from flexpipe.cost.limits import LimitLike, MemLimit
from flexpipe.cost.model import CostModel
from flexpipe.dsl.cutoff import Cutoff, CutoffReached
from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.dualpipe_twoway import TWO_WAY
from flexpipe.search.bounds import dominated, fill_bound, warmup_applies
from flexpipe.search.costs import fit_cost, fit_placement, per_direction, rank_mb_act, span_bound
from flexpipe.search.ladder import ladder_trials
from flexpipe.search.polish import polish
from flexpipe.search.prove import prove_across
from flexpipe.search.ranking import EPS, Progress, Ranking, objective_key, simulated
from flexpipe.search.recompute import recompute_trials
from flexpipe.search.result import SearchResult, Trial, over_budget
from flexpipe.search.space import (
    Candidate,
    build,
    held_lower_bound,
    iter_space,
    placement_of,
)
from flexpipe.sim.engine import simulate

if TYPE_CHECKING:
    from flexpipe.graphs.model import GraphModel

@dataclass(kw_only=True)
class _Context(Ranking):
    """The fixed inputs of one chain search, its fitted cost models and its ranking."""

    cost: CostModel
    p: int
    m: int
    fitted: dict[tuple[int, bool], CostModel] = field(default_factory=dict)
    prune: bool = True
    objective: str = "makespan"

    def cutoff(self) -> Cutoff | None:
        """Where a list-scheduler build may stop: the incumbent's objective value (None
        without an incumbent or with pruning off)."""
        if not self.prune or self.best is None:
            return None
        return Cutoff(self.objective, self.key(self.best)[0])

    def fit(self, placement: Placement) -> CostModel:
        """The cost model fitted to ``placement`` (``costs.fit_placement``), kept."""
        key = (placement.num_stages, placement.kind == TWO_WAY)
        if key not in self.fitted:
            self.fitted[key] = fit_placement(self.cost, placement)
        return self.fitted[key]


def search(cost: CostModel | None, p: int, m: int, mem_limit: LimitLike | None, *,
           exact: bool = False,
           time_limit: float = 10.0, progress: Progress | None = None, library: bool = True,
           synthesis: bool = True, objective: str = "makespan",
           max_seconds: float | None = None, max_candidates: int | None = None,
           graph: Sequence[GraphModel] | None = None,
           exact_placements: bool = False,
           placements: Sequence[str] | None = None, prune: bool = True,
           seeds: Sequence[Schedule] = (), recompute: bool = True) -> SearchResult:
    """Find the fastest schedule for ``cost`` (None: unit costs, F = B = W = 1 per rank) on p
    ranks with m micro-batches whose peak activation fits ``mem_limit`` (one number, or one per
    rank, in the cost model's ``act`` units) on every rank.

    ``exact``: improve the best with the CP-SAT optimiser for ``time_limit`` seconds; its
    report's ``claim`` says what it proves (optimal for the best's placement and split mode
    only). ``exact_placements``: also solve every placement searched exactly
    (``search.prove``): when all are optimal, optimality across them is proven.
    ``progress(done, total, label)`` is called before each candidate. ``library``/``synthesis``
    switch the two halves of the space. ``objective``: "makespan" (the default: first
    pass start to last pass end over all ranks, the true step time) or "span" (the largest
    per-rank span, what the bubble rate measures); the best schedule's cool-down is then
    polished for it (``search.polish``). ``max_candidates``: the effort budget, candidates
    tried in the space's fixed order (None: all), so the same input gives the same answer on an
    idle and on a loaded machine; ``max_seconds``: an optional wall-clock limit on top (the
    answer then depends on the machine's load).

    ``placements``: search only candidates on these placement kinds (e.g. ``("linear",)``;
    None: all). ``prune=False`` builds and simulates every candidate (the bound and dominance
    rules of ``search.bounds`` off; the memory closed forms stay), to check those rules.

    ``recompute``: also try each library candidate that does not fit with selective or full
    recompute on the stages of its ranks that are over (``search.recompute``: the cheapest
    that fits, priced from the cost model; its trial's ``recompute`` says what and the cost).

    ``seeds``: schedules for the same p and m (e.g. the winners at smaller limits, which fit
    any larger one: ``search.frontier``) simulated and ranked first, as trials labelled
    ``seed: NAME``; the answer is then never worse than any seed that fits.

    ``graph``: layouts of a model that is not a chain (``flexpipe.graphs``, e.g.
    ``preset_layouts("clip", p)``); the search then runs ``flexpipe.search.graphs.search_graph``
    over them (``cost`` must be None: each layout brings its own; ``mem_limit`` None means the
    chain-only 1F1B baseline's peak)."""
    if graph is not None:
        return _search_graph(cost, p, m, mem_limit, graph, exact=exact, time_limit=time_limit,
                             progress=progress, objective=objective, max_seconds=max_seconds,
                             max_candidates=max_candidates)
    if mem_limit is None:
        raise ConfigError("give a memory limit (one number, or one per rank)")
    ctx = _start(cost, p, m, mem_limit, objective)
    ctx.prune = prune
    t0 = time.perf_counter()
    space = list(iter_space(p, m, library=library, synthesis=synthesis))
    if placements is not None:
        space = [c for c in space if _kind(c, p) in placements]
    trials = [_seeded(seed, ctx) for seed in seeds]
    walked = _walk(space, ctx, progress, t0, max_candidates, max_seconds)
    trials += walked
    if max_candidates is None and max_seconds is None:  # the monotone frontier (search/ladder)
        trials += ladder_trials(space, p, ctx.limits, lambda c: _fitted(c, ctx),
                                lambda c, level: _evaluate(c, ctx, level))
    trials += _polished(ctx)
    if recompute and not over_budget(0, t0, None, max_seconds):  # after the plain best's polish,
        before = ctx.best  # so that recompute never leaves a worse answer than none
        trials += recompute_trials(list(zip(space, walked, strict=True)), ctx)
        if ctx.best is not before:
            trials += _polished(ctx)
    if progress is not None:
        progress(len(space), len(space), "done")
    bound = min(_bounds(ctx, space, p, m), default=0.0)
    result = ctx.result(trials, bound)
    best = ctx.best
    if exact and best is not None and best.schedule is not None:
        ctx.improve_best(result, ctx.fit(best.schedule.placement), time_limit,
                         label=f"exact[{best.placement}] from {best.label}",
                         name=f"search:exact {best.label}")
    if exact_placements and ctx.best is not None:
        prove_across(result, ctx, ctx.fit, time_limit)
    result.seconds = time.perf_counter() - t0
    return result


def _walk(space: list[Candidate], ctx: _Context, progress: Progress | None, t0: float,
          max_candidates: int | None, max_seconds: float | None) -> list[Trial]:
    """Every candidate of ``space`` evaluated in order (or skipped once the budget is spent)."""
    out = []
    for i, cand in enumerate(space):
        if progress is not None:
            progress(i, len(space), cand.label)
        skip = over_budget(i, t0, max_candidates, max_seconds)
        if skip:
            out.append(_trial(cand, skip, f"{skip[9:-1]} budget spent"))
            continue
        out.append(_evaluate(cand, ctx))
    return out


def _polished(ctx: _Context) -> list[Trial]:
    """The best schedule with its cool-down W passes moved where the objective falls
    (``search.polish``), as one more ranked trial; [] when no move helps."""
    best = ctx.best
    if best is None or best.schedule is None:
        return []
    t0 = time.perf_counter()
    sched = best.schedule
    cost = ctx.fit(sched.placement)
    found = polish(sched, cost, ctx.limits,
                   lambda met: ctx.key(simulated("", "", "", None, sched, met, 0.0)))
    if found is None:
        return []
    trial = simulated(f"{best.label} +polish", best.family, best.placement, best.bound,
                      found[0].renamed(f"{sched.name} +polish"), found[1],
                      time.perf_counter() - t0)
    if best.recompute is not None:  # the same recompute, the polished step time
        trial.recompute = replace(best.recompute, makespan=found[1].makespan)
    ctx.rank(trial)
    return [trial]


def _seeded(seed: Schedule, ctx: _Context) -> Trial:
    """A given schedule simulated and ranked like a candidate (``search(seeds=...)``)."""
    if seed.num_ranks != ctx.p or seed.microbatches != ctx.m:
        raise ConfigError(f"seed {seed.name!r} is for p = {seed.num_ranks}, m = "
                          f"{seed.microbatches}, not p = {ctx.p}, m = {ctx.m}")
    t0 = time.perf_counter()
    label = f"seed: {seed.name}"
    try:
        metrics = simulate(seed, ctx.fit(seed.placement)).metrics()
    except FlexPipeError as exc:
        return Trial(label, "seed", seed.placement.kind, "invalid", str(exc).splitlines()[0])
    trial = simulated(label, "seed", seed.placement.kind, None, seed, metrics,
                      time.perf_counter() - t0)
    ctx.rank(trial)
    return trial


def _kind(cand: Candidate, p: int) -> str:
    """The placement kind ``cand`` runs on ("invalid" when it has none for p)."""
    try:
        return placement_of(cand, p).kind
    except FlexPipeError:
        return "invalid"


def _search_graph(cost: CostModel | None, p: int, m: int, mem_limit: LimitLike | None,
                  models: Sequence[GraphModel], **kw: Any) -> SearchResult:
    """``search`` over the layouts of a stage-graph model."""
    from flexpipe.search.graphs import search_graph

    if cost is not None:
        raise ConfigError("a graph model brings its own cost model: pass cost=None")
    if any(gm.placement.num_ranks != p for gm in models):
        raise ConfigError(f"the graph layouts are not laid out on p = {p} devices")
    return search_graph(models, m, mem_limit, **kw)


def _start(cost: CostModel | None, p: int, m: int, mem_limit: LimitLike,
           objective: str) -> _Context:
    for name, value in (("p", p), ("m", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    key = objective_key(objective)
    cost = cost or CostModel.uniform(p, p)
    if cost.comm.num_ranks < p:
        raise ConfigError(f"the cost model's links cover {cost.comm.num_ranks} ranks, not {p}")
    fit_cost(cost, p)  # a clear error now when the stages cannot fit p ranks
    return _Context(MemLimit.of(mem_limit).per_rank(p, cost), key, cost=cost, p=p, m=m,
                    objective=objective)


def _bounds(ctx: _Context, space: list[Candidate], p: int, m: int) -> list[float]:
    """The span lower bound of every searched placement the cost model can be cut into."""
    out = []
    for pl in {placement_of(c, p).stage_rank: placement_of(c, p) for c in space}.values():
        try:
            out.append(span_bound(ctx.fit(pl), pl, per_direction(pl, m)))
        except FlexPipeError:
            continue  # those candidates were reported invalid
    return out


def _trial(cand: Candidate, status: str, reason: str = "", bound: float | None = None) -> Trial:
    return Trial(cand.label, cand.family, cand.placement, status, reason, bound)


def _fitted(cand: Candidate, ctx: _Context) -> tuple[CostModel, Placement] | None:
    """The candidate's fitted cost model and placement, None when it cannot be built."""
    try:
        placement = placement_of(cand, ctx.p)
        return ctx.fit(placement), placement
    except FlexPipeError:
        return None


def _evaluate(cand: Candidate, ctx: _Context, level: float | None = None) -> Trial:
    """Prune, build, simulate and rank one candidate (updates the incumbent); a limit-driven
    candidate is built for ``level`` instead of the limits when given (``search.ladder``)."""
    t0 = time.perf_counter()
    try:
        placement = placement_of(cand, ctx.p)
        cost = ctx.fit(placement)
        runs = per_direction(placement, ctx.m)
    except FlexPipeError as exc:
        return _trial(cand, "invalid", str(exc).splitlines()[0])
    cand = replace(cand, placement=placement.kind)
    bound = fill_bound(cost, placement, runs, ctx.limits) if warmup_applies(cand) else \
        span_bound(cost, placement, runs)
    limits = ctx.limits if level is None else tuple(min(level, x) for x in ctx.limits)
    pruned = _prune(cand, ctx, cost, placement, bound, limits)
    if pruned is not None:
        return pruned
    try:
        schedule = build(cand, ctx.p, ctx.m, cost, limits, ctx.cutoff())
        metrics = simulate(schedule, cost).metrics()
    except CutoffReached as exc:
        return _trial(cand, "pruned (bound)", f"stopped while built: {exc}", bound)
    except FlexPipeError as exc:
        return _trial(cand, "invalid", str(exc).splitlines()[0][:120], bound)
    label = cand.label if level is None else f"{cand.label} @mem={level:g}"
    trial = simulated(label, cand.family, cand.placement, bound, schedule, metrics,
                      time.perf_counter() - t0)
    ctx.rank(trial)
    return trial


def _prune(cand: Candidate, ctx: _Context, cost: CostModel, placement: Placement,
           bound: float, limits: tuple[float, ...]) -> Trial | None:
    """A pruned trial when a closed form, a bound or a dominance rule (``search.bounds``)
    rules the candidate out, else None; ``limits``: what it would be built for."""
    per_mb = rank_mb_act(cost, placement)
    held = held_lower_bound(cand, ctx.p, ctx.m)
    if held is not None and held * per_mb[0] > ctx.limits[0] + EPS:
        return _trial(cand, "pruned (memory)", f"rank 0 holds {held} micro-batches "
                      f"({held * per_mb[0]:g} > {ctx.limits[0]:g})", bound)
    over = [r for r in range(ctx.p) if per_mb[r] > ctx.limits[r] + EPS]
    if over and cand.family == "policy":
        r = over[0]
        return _trial(cand, "pruned (memory)", f"one micro-batch needs {per_mb[r]:g} on rank "
                      f"{r} (limit {ctx.limits[r]:g})", bound)
    if not ctx.prune:
        return None
    if dominated(cand, limits, cost, placement):
        return _trial(cand, "pruned (dominated)", "holds at most p/3, p/2 or p M_B: never the "
                      "best at 1F1B's memory or more (search.bounds)", bound)
    best = ctx.key(ctx.best)[0] if ctx.best is not None else None  # span or makespan
    if best is not None and bound >= best * (1 - EPS):  # span <= makespan: both are bounded
        return _trial(cand, "pruned (bound)", f"span >= {bound:g} >= the best's {best:g}",
                      bound)
    return None
