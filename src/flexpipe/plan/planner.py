"""The joint choice: stages (cuts), devices (path), schedule and micro-batch size.

For every allowed micro-batch size, candidates come from one of two generators:

- exact (small problems, at most ``Options.exact_limit`` (path, cuts) pairs): every ordered
  selection of devices and every contiguous partition, for the linear schedules; the virtual-stage
  schedules get the dynamic-programming cuts on every path;
- heuristic (large problems): a few device paths along fast links (``mapping``), cut by dynamic
  programming (``partition``) for each placement kind.

Candidates are ordered by the pipeline formula (those that 1F1B's closed-form memory says cannot
fit go last) and simulated in that order; one whose lower
bound is no better than the best simulated time is skipped, so when the simulation budget is not
spent the answer is optimal over the space (``Plan.optimal``). A heuristic answer is then
polished by moving stage boundaries one layer at a time (``polish``), starting from the best
plan of each of the three best device paths. Finally the automated
scheduler (``flexpipe.search``) may replace the library schedule on the winning stages and
devices.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import combinations
from math import comb

from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.plan.evaluate import (
    Candidate,
    Outcome,
    can_fit,
    chunks_of,
    estimate,
    is_linear,
    likely_fits,
    simulate_candidate,
)
from flexpipe.plan.mapping import all_paths, count_paths, heuristic_paths
from flexpipe.plan.partition import Costs, Held, partitions, uniform_cuts
from flexpipe.plan.polish import polish
from flexpipe.plan.problem import Cluster, Model
from flexpipe.plan.refine import refine
from flexpipe.schedules.registry import names

POLISHED_PATHS = 3  # device paths whose best plan is polished
HARD_CAP = 10  # with nothing fitting yet, simulate up to this many budgets before giving up
DEFAULT_FAMILIES = ("1f1b", "zb-h1", "zb-h2", "gpipe", "interleaved-1f1b", "zb-v",
                    "1f1b-recompute")


@dataclass(frozen=True)
class Options:
    """Knobs of the planner."""

    families: tuple[str, ...] = DEFAULT_FAMILIES
    """Library schedules to choose from (any name of ``flexpipe.schedules.registry``)."""
    mapping: str = "search"
    """"search": choose the devices and their order; "index": devices in index order."""
    exact_limit: int = 20000
    """Enumerate every (path, cuts) pair when there are at most this many."""
    sim_budget: int = 400
    """Most simulations in one plan."""
    keep_paths: int = 3
    """Heuristic device paths kept per micro-batch size."""
    polish_sims: int = 300
    """Effort of the boundary-moving local search on the leading plans: simulations in all
    (0: none). Budgets are counts, so a plan is the same on an idle and a loaded machine."""
    polish_seconds: float | None = None
    """Optional wall-clock limit on that local search (0: none; the plan then depends on the
    machine's load)."""
    refine_candidates: int = 24
    """Effort of the automated scheduler on the winner: candidates tried, in its fixed order
    (0: library schedules only)."""
    refine_seconds: float | None = None
    """Optional wall-clock limit on the automated scheduler (0: library schedules only)."""


@dataclass
class Plan:
    """The planner's answer: the best simulated outcome and how it was found."""

    best: Outcome
    schedule_name: str
    optimal: bool
    simulated: int
    seconds: float
    model: Model = field(repr=False)
    cluster: Cluster = field(repr=False)


def _check(model: Model, cluster: Cluster, options: Options) -> None:
    known = names()
    unknown = [f for f in options.families if f not in known]
    if unknown or not options.families:
        raise ConfigError(f"unknown schedule families {unknown} (known: {', '.join(known)})")
    if options.mapping not in ("search", "index"):
        raise ConfigError(f"mapping must be 'search' or 'index', got {options.mapping!r}")


def _space_size(model: Model, cluster: Cluster, limit: int) -> int:
    """(path, cuts) pairs of the exact mode, counted until they pass ``limit``."""
    n, layers, total = cluster.size, len(model.layers), 0
    for k in range(1, min(n, layers) + 1):
        total += count_paths(n, k) * comb(layers - 1, k - 1)
        if total > limit:
            break
    return total


def _all_cuts(layers: int, k: int) -> Iterator[tuple[int, ...]]:
    for inner in combinations(range(1, layers), k - 1):
        yield (0, *inner, layers)


def _held(m: int, chunks: int) -> Held:
    """Micro-batches of activation stage s may hold: 1F1B's ``min(m, p - rank)``."""
    return lambda s, stages: min(m, stages // chunks - s % (stages // chunks))


def _dp_candidates(model: Model, cluster: Cluster, path: tuple[int, ...], family: str, b: int,
                   m: int) -> Iterator[Candidate]:
    """Dynamic-programming cuts of ``family``'s placement on ``path``."""
    chunks = chunks_of(family)
    if len(model.layers) < chunks * len(path):
        return
    probe = Candidate(family, path, (0,) * (chunks * len(path) + 1), b, m)
    costs = Costs(model, cluster, probe.stage_devices(), b, _held(m, chunks), 1.0 / chunks)
    for cuts in [*partitions(costs), uniform_cuts(len(model.layers), len(probe.cuts) - 1)]:
        yield Candidate(family, path, cuts, b, m)


def _exact(model: Model, cluster: Cluster, options: Options, b: int,
           m: int) -> Iterator[Candidate]:
    n, layers = cluster.size, len(model.layers)
    linear = [f for f in options.families if is_linear(f)]
    others = [f for f in options.families if not is_linear(f)]
    for path in all_paths(n, range(1, min(n, layers) + 1)):
        for cuts in _all_cuts(layers, len(path)):
            yield from (Candidate(f, path, cuts, b, m) for f in linear[:1])
        for fam in others:
            if len(path) > 1:
                yield from _dp_candidates(model, cluster, path, fam, b, m)


def _heuristic(model: Model, cluster: Cluster, options: Options, b: int,
               m: int) -> Iterator[Candidate]:
    k = min(cluster.size, len(model.layers))
    if options.mapping == "index":
        paths = [tuple(range(k))]
    else:
        nbytes = b * sorted(x.out_bytes for x in model.layers)[len(model.layers) // 2]
        paths = [p[:k] for p in heuristic_paths(cluster, nbytes, options.keep_paths)]
    linear = [f for f in options.families if is_linear(f)]
    for path in dict.fromkeys(paths):
        for fam in [*linear[:1], *(f for f in options.families if not is_linear(f))]:
            yield from _dp_candidates(model, cluster, path, fam, b, m)


def _candidates(model: Model, cluster: Cluster,
                options: Options) -> tuple[list[Candidate], bool]:
    """Every candidate, and whether they cover the whole space (exact mode)."""
    limit = options.exact_limit
    exact = options.mapping == "search" and _space_size(model, cluster, limit) <= limit
    gen = _exact if exact else _heuristic
    out = []
    for b, m in model.choices():
        out += list(gen(model, cluster, options, b, m))
    return list(dict.fromkeys(out)), exact  # the DP and the uniform cut may agree


def _expand(cand: Candidate, options: Options) -> list[Candidate]:
    """A linear candidate stands for every linear family chosen."""
    if not is_linear(cand.family):
        return [cand]
    return [replace(cand, family=f) for f in options.families if is_linear(f)]


def _order(model: Model, cluster: Cluster, cand: Candidate) -> tuple[bool, float, float]:
    """Sort key: likely to fit memory first, then by the estimate; and the lower bound."""
    est, bound = estimate(model, cluster, cand)
    return not likely_fits(model, cluster, cand), est, bound


def _polish_leaders(model: Model, cluster: Cluster, per_path: dict[tuple[int, ...], Outcome],
                    options: Options) -> tuple[Outcome, int]:
    """Polish the best outcomes of the ``POLISHED_PATHS`` best device paths, best first, in one
    shared budget of simulations (and the optional time limit; each stops at its local
    optimum): the best path before polishing is not always the best after. The best polished
    outcome and the simulations it took."""
    seconds = options.polish_seconds
    deadline = None if seconds is None else time.perf_counter() + seconds
    leaders = sorted(per_path.values(), key=lambda o: o.makespan)[:POLISHED_PATHS]
    best, sims = leaders[0], 0
    for lead in leaders:
        left = None if deadline is None else deadline - time.perf_counter()
        if (left is not None and left <= 0) or sims >= options.polish_sims:
            break
        out, more = polish(model, cluster, lead, options.polish_sims - sims, left)
        sims += more
        if out.makespan < best.makespan:
            best = out
    return best, sims


def plan(model: Model, cluster: Cluster, options: Options | None = None) -> Plan:
    """Choose cuts, devices, schedule and micro-batch size for ``model`` on ``cluster`` that
    minimise the simulated iteration time within every device's memory."""
    options = options or Options()
    _check(model, cluster, options)
    t0 = time.perf_counter()
    cands, optimal = _candidates(model, cluster, options)
    scored = sorted(((_order(model, cluster, c), c) for c in cands
                     if can_fit(model, cluster, c)), key=lambda x: x[0])
    per_path: dict[tuple[int, ...], Outcome] = {}  # the best outcome of every device path
    best: Outcome | None = None  # the best of them
    sims = 0
    for (_, _est, bound), cand in scored:
        if best is not None and bound >= best.makespan * (1 - 1e-9):
            continue
        if sims >= options.sim_budget * (1 if best is not None else HARD_CAP):
            optimal = False
            break
        for one in _expand(cand, options):
            sims += 1
            out = simulate_candidate(model, cluster, one)
            held = per_path.get(one.path)
            if out is not None and out.fits and (held is None or out.makespan < held.makespan):
                per_path[one.path] = out
                if best is None or out.makespan < best.makespan:
                    best = out
    if best is None:
        raise InfeasibleError(f"no plan of model {model.name!r} fits the memory of cluster "
                              f"{cluster.name!r} (tried {sims} simulated candidates)")
    if not optimal and options.polish_sims > 0 and options.polish_seconds != 0:
        best, more = _polish_leaders(model, cluster, per_path, options)
        sims += more
    name = best.schedule.name
    if options.refine_candidates > 0 and options.refine_seconds != 0:
        better = refine(cluster, best, options.refine_candidates, options.refine_seconds)
        if better is not None:
            best, name = better, better.schedule.name
    return Plan(best, name, optimal, sims, time.perf_counter() - t0, model, cluster)
