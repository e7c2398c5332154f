"""Search schedules for stage graphs (two towers, encoder-decoder, sharded blocks): every layout
of the model x a grid of list-scheduler knobs (``flexpipe.dsl.policy``, which follows any stage
graph and runs gangs together), ranked like the chain search (``flexpipe.search.engine``), and
optionally improved by the CP-SAT optimiser (exactly when small, by windows otherwise).

The warm-up depth ``ahead`` generalises 1F1B's p - r: on rank r it is a x d(r) + b micro-batches,
where d(r) is the longest path (in stages) from one of r's stages to a loss stage; on a chain,
d(r) = p - r."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

from flexpipe.cost.limits import LimitLike, MemLimit
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.graphs.model import GraphModel, chain_baseline
from flexpipe.ir.graph import StageGraph
from flexpipe.search.costs import span_bound
from flexpipe.search.ranking import Progress, Ranking, objective_key, simulated
from flexpipe.search.repetend import repetend_trials
from flexpipe.search.result import SearchResult, Trial, over_budget
from flexpipe.sim.engine import simulate

AHEAD: dict[str, tuple[float, float] | None] = {
    "none": None, "0.75p": (0.75, 0.0), "1p": (1.0, 0.0), "2p": (2.0, 0.0)}
# The list scheduler's knobs: kind preference, warm-up depth, ``mem`` (the share of the memory
# limit the scheduler plans with: a tighter plan hoards fewer forwards), memory reservation
# ("auto" tries none, then all; "all" on its own), the fused backward, and for gangs how a
# collective waits for its members (``Policy.gang_wait``).
KNOBS: tuple[tuple[tuple[str, object], ...], ...] = (
    *((("prefer", pr), ("ahead", ah), ("mem", mem)) for mem in (1.0, 0.9, 0.8)
      for pr in ("BFW", "FBW") for ah in AHEAD),
    (("prefer", "BFW"), ("reserve", "all")), (("prefer", "FBW"), ("reserve", "all")),
    (("split", False), ("ahead", "none")), (("split", False), ("ahead", "1p")),
)
# Extra knobs for models with gangs: collectives chosen only when every member's rank is free.
GANG_KNOBS: tuple[tuple[tuple[str, object], ...], ...] = (
    (("prefer", "BFW"), ("gang", "ready"), ("mem", 0.9)),
    (("prefer", "FBW"), ("gang", "ready"), ("mem", 0.9)),
)


@dataclass(frozen=True)
class GraphCandidate:
    """One point of the graph space: a layout of the model and the list scheduler's knobs."""

    model: GraphModel
    knobs: tuple[tuple[str, object], ...]

    @property
    def label(self) -> str:
        """E.g. ``policy@shared prefer=BFW reserve=auto ahead=2p`` (no brackets: rich markup)."""
        return f"policy@{self.model.layout} " + " ".join(f"{k}={v}" for k, v in self.knobs)


def depths(graph: StageGraph, stage_rank: Sequence[int], p: int) -> tuple[int, ...]:
    """Per rank, the longest path (in stages, itself included) from one of its stages to a
    sink: p - r on a chain."""
    @cache
    def depth(s: int) -> int:
        return 1 + max((depth(t) for t in graph.succs[s]), default=0)

    out = [0] * p
    for s, r in enumerate(stage_rank):
        out[r] = max(out[r], depth(s))
    return tuple(out)


def _ahead(cand: GraphCandidate) -> Callable[[int], float] | None:
    """The warm-up depth per rank of ``cand``'s ``ahead`` knob (None: unlimited)."""
    rule = AHEAD[str(dict(cand.knobs).get("ahead", "none"))]
    if rule is None:
        return None
    pl = cand.model.placement
    d = depths(cand.model.graph, pl.stage_rank, pl.num_ranks)
    a, b = rule

    def ahead(r: int) -> float:
        return max(1, round(a * d[r] + b))

    return ahead


def _policy(cand: GraphCandidate, limits: tuple[float, ...]) -> Policy:
    """The list scheduler's policy for ``cand`` under per-rank ``limits``."""
    kw = dict(cand.knobs)
    ahead = _ahead(cand)
    return Policy(prefer=tuple(str(kw.get("prefer", "BFW"))), split=bool(kw.get("split", True)),
                  mem_limit=[float(kw.get("mem", 1.0)) * x for x in limits],  # type: ignore[arg-type]
                  reserve=str(kw.get("reserve", "auto")),
                  max_ahead=ahead, gang_wait=kw.get("gang", "wait") == "wait")


def baseline_limit(model: GraphModel, m: int) -> float:
    """The chain-only 1F1B baseline's peak activation (largest rank): the default limit."""
    schedule, cost = chain_baseline(model, m)
    return max(simulate(schedule, cost).metrics().peak_activation)


def search_graph(models: Sequence[GraphModel], m: int, mem_limit: LimitLike | None = None, *,
                 exact: bool = False, time_limit: float = 10.0, objective: str = "makespan",
                 progress: Progress | None = None,
                 max_seconds: float | None = None,
                 max_candidates: int | None = None) -> SearchResult:
    """The fastest schedule over every layout in ``models`` (one model, several layouts on the
    same p devices) with m micro-batches whose peak activation fits ``mem_limit`` on every rank
    (default: the chain-only 1F1B baseline's peak). ``exact``: improve the best with CP-SAT for
    ``time_limit`` seconds. Other arguments as ``flexpipe.search.search``."""
    p, key = _check(models, m), objective_key(objective)
    limit = baseline_limit(models[0], m) if mem_limit is None else mem_limit
    ctx = Ranking(MemLimit.of(limit).per_rank(p, models[0].cost), key)
    t0 = time.perf_counter()
    space = [GraphCandidate(gm, knobs) for gm in models
             for knobs in KNOBS + (GANG_KNOBS if gm.graph.gangs else ())]
    trials = []
    for i, cand in enumerate(space):
        if progress is not None:
            progress(i, len(space), cand.label)
        skip = over_budget(i, t0, max_candidates, max_seconds)
        if skip:
            trials.append(Trial(cand.label, "policy", cand.model.layout, skip))
            continue
        trials.append(_evaluate(cand, ctx, m))
    if max_candidates is None and max_seconds is None:  # tiled repetends (search.repetend)
        trials += repetend_trials(models, m, ctx)
    bound = min(span_bound(gm.cost, gm.placement, m) for gm in models)
    result = ctx.result(trials, bound)
    best = ctx.best
    if exact and best is not None:
        gm = next(gm for gm in models if gm.layout == best.placement)
        ctx.improve_best(result, gm.cost, time_limit, label=f"exact@{gm.layout} from {best.label}",
                         name=f"search:exact {gm.name} {best.label}")
    result.seconds = time.perf_counter() - t0
    return result


def _check(models: Sequence[GraphModel], m: int) -> int:
    """The device count of ``models``; a ConfigError for unusable search inputs."""
    if not models:
        raise ConfigError("search_graph needs at least one model layout")
    p = models[0].placement.num_ranks
    if any(gm.placement.num_ranks != p for gm in models):
        raise ConfigError("every layout searched together must use the same number of devices")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"m must be a positive integer, got {m!r}")
    return p


def _evaluate(cand: GraphCandidate, ctx: Ranking, m: int) -> Trial:
    """Build, simulate and rank one candidate with m micro-batches."""
    t0 = time.perf_counter()
    gm = cand.model
    bound = span_bound(gm.cost, gm.placement, m)
    try:
        schedule = policy_schedule(gm.placement, m, _policy(cand, ctx.limits), gm.cost,
                                   gm.graph, name=f"search:{gm.name} {cand.label}")
        metrics = simulate(schedule, gm.cost).metrics()
    except FlexPipeError as exc:
        return Trial(cand.label, "policy", gm.layout, "invalid", str(exc).splitlines()[0][:120],
                     bound)
    trial = simulated(cand.label, "policy", gm.layout, bound, schedule, metrics,
                      time.perf_counter() - t0)
    ctx.rank(trial)
    return trial
