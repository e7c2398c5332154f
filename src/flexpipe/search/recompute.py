"""Recompute traded for memory (``search(..., recompute=True)``, the default): a library
candidate that does not fit the limit without it is tried with selective recompute (SR: the
stage drops ``act - sr_act`` of each micro-batch after its forward, the profile's measured
figure, and redoes it before the backward) or full recompute (R: it keeps only its stage input)
on the stages of the ranks that are over, and ranked like any other candidate: the fastest
schedule that fits wins, so under a loose limit no recompute is chosen (it only costs time).

Which stages. A rank's activation memory is set by its own op order (every op of these
schedules runs on the rank's compute stream, one after the other), and recompute on a stage
changes only what that stage's micro-batches hold, on its rank. So each rank is planned
alone: its options, every assignment of nothing, SR or R to its stages, are ordered by the
recompute passes' time priced from the cost model (micro-batches x SR's or R's time on each
stage; ties: fewer stages), each option's peak is read off the candidate's memory curve
(``search.recompute_plans``), and the rank takes the first that fits its limit. The plan is
then simulated; a rank the simulation finds still over (the two differ only on ties in time)
moves to its next option, one simulation a round, until every rank fits. So the plan found
is the cheapest that fits: its priced time is the sum of the ranks', each the least that
fits (``tests/test_search_recompute.py`` checks it against every assignment of small cases).
When no option fits some rank, the assignment that holds least on every stage is simulated:
if even that leaves a rank over, the candidate cannot fit and that variant is the trial
recorded (its peak is the least the candidate reaches).

Bounds. A variant's span on rank r is at least the rank's work plus its plan's priced time;
before a candidate is built, the least of that over the rank's options, plus, where the
warm-up bound applies, the idle time before its first backward that forwards holding what
the option leaves them and one recompute pass cannot fill (``bounds.recompute_bound``). A
candidate or a round whose bound is no better than the incumbent is not simulated.
Where no stage has ``after_w`` times, adding recompute passes to an order delays nothing
(every start is a max of ends), so a variant's makespan is at least its candidate's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Protocol

from flexpipe.cost.model import CostModel
from flexpipe.errors import FlexPipeError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.recompute import recompute_stages
from flexpipe.search.bounds import recompute_bound
from flexpipe.search.costs import per_direction, rank_work
from flexpipe.search.ranking import EPS, Key, simulated
from flexpipe.search.recompute_plans import (
    Option,
    Plan,
    least_plan,
    option_peaks,
    rank_options,
    recompute_time,
)
from flexpipe.search.result import RecomputeNote, Trial, stage_ranges
from flexpipe.search.space import Candidate, build, placement_of
from flexpipe.sim.engine import simulate
from flexpipe.sim.trace import Metrics

PLAIN_KINDS = frozenset({"F", "B", "W", "BW"})
"""The kinds a candidate may have to be tried with recompute (no offload, FSDP or recompute
of its own: their memory does not follow the rank's compute order alone)."""
MAX_CHUNKS = 4
"""Stages per rank at most (3^4 options a rank)."""
ELIGIBLE = ("over memory", "pruned (memory)", "pruned (bound)")


class Context(Protocol):
    """What the phase reads of the search (``search.engine``'s context)."""

    p: int
    m: int
    limits: tuple[float, ...]
    best: Trial | None
    prune: bool
    objective: str

    @property
    def key(self) -> Key:
        """The objective's ranking key."""

    def rank(self, trial: Trial) -> None:
        """Rank a simulated trial."""

    def fit(self, placement: Placement) -> CostModel:
        """The cost model fitted to ``placement``."""


def recompute_trials(walked: Sequence[tuple[Candidate, Trial]], ctx: Context) -> list[Trial]:
    """The recompute variants of the walked library candidates that do not fit (or were
    pruned before it was known), as ranked trials (module docstring)."""
    out = []
    for cand, trial in walked:
        if cand.family != "policy" and trial.status in ELIGIBLE:
            got = _variant(cand, trial, ctx)
            if got is not None:
                out.append(got)
    return out


def cheapest_recompute(schedule: Schedule, cost: CostModel,
                       limits: Sequence[float]) -> tuple[Plan, Metrics] | None:
    """The cheapest recompute plan ((stage, SR or R) pairs) with which ``schedule`` (F, B, W
    and BW ops only) fits ``limits`` under ``cost`` (fitted to it), and its metrics, as the
    search finds it without bounds; the least-memory plan (over the limit) when none fits;
    None when it fits without (module docstring)."""
    case = _of(schedule, cost, tuple(limits))
    found = None if case is None else _fitted(case, lambda at: False)
    return None if found is None else found[:2]


@dataclass
class _Case:
    """One candidate being fitted: its plain schedule, metrics and per-rank options."""

    label: str
    family: str
    schedule: Schedule
    plain: Metrics
    cost: CostModel
    limits: tuple[float, ...]
    options: list[list[Option]]
    work: tuple[float, ...]


def _variant(cand: Candidate, trial: Trial, ctx: Context) -> Trial | None:
    """``cand`` with the cheapest recompute that fits, or its least-memory variant when none
    does; None when it fits without, cannot be tried or cannot win."""
    t0 = time.perf_counter()
    try:
        placement = placement_of(cand, ctx.p)
        cost = ctx.fit(placement)
        runs = per_direction(placement, ctx.m)
    except FlexPipeError:
        return None
    if max(map(len, placement.rank_stages)) > MAX_CHUNKS:
        return None
    bound = recompute_bound(cand, cost, placement, runs, ctx.limits)
    if _beaten(bound, ctx):
        return None
    case = _case(cand, trial, ctx, cost)
    if case is None:
        return None
    found = _fitted(case, lambda at: _beaten(_round_bound(case, at, ctx.objective), ctx))
    if found is None:
        return None
    return _trial(case, *found, ctx, bound, time.perf_counter() - t0)


def _case(cand: Candidate, trial: Trial, ctx: Context, cost: CostModel) -> _Case | None:
    """The candidate's case (its plain schedule built and simulated when it was pruned)."""
    schedule, plain = trial.schedule, trial.metrics
    if schedule is None or plain is None:
        if not plain_family(cand.family, cand.params):
            return None
        try:
            schedule = build(cand, ctx.p, ctx.m, cost, ctx.limits)
            plain = simulate(schedule, cost).metrics()
        except FlexPipeError:
            return None
    return _of(schedule, cost, ctx.limits, plain, trial.label, cand.family)


@cache
def plain_family(family: str, params: tuple[tuple[str, object], ...]) -> bool:
    """Whether a library family (with ``params``) emits only ``PLAIN_KINDS``: read off a small
    instance (p = 2, m = 4), so that a pruned candidate that cannot be tried is not built."""
    from flexpipe.schedules.registry import build as build_library

    try:
        return build_library(family, 2, 4, **dict(params)).kinds() <= PLAIN_KINDS
    except FlexPipeError:
        return False


def _of(schedule: Schedule, cost: CostModel, limits: tuple[float, ...],
        plain: Metrics | None = None, label: str = "", family: str = "") -> _Case | None:
    """``schedule``'s case, None when it has kinds other than F, B, W, BW, more than
    ``MAX_CHUNKS`` stages on a rank, or fits without recompute."""
    if not schedule.kinds() <= PLAIN_KINDS or \
            max(map(len, schedule.placement.rank_stages)) > MAX_CHUNKS:
        return None
    plain = plain or simulate(schedule, cost).metrics()
    if not _over(plain, limits):
        return None
    runs = schedule.microbatches
    options = [rank_options(cost, stages, runs) for stages in schedule.placement.rank_stages]
    return _Case(label or schedule.name, family, schedule, plain, cost, limits, options,
                 rank_work(cost, schedule.placement, runs))


def _fitted(case: _Case, cut: Callable[[list[int]], bool]) -> tuple[Plan, Metrics,
                                                                     Schedule] | None:
    """The cheapest plan that fits: each rank's first option whose peak fits its limit
    (``recompute_plans``), simulated, then, while a rank is over, its next options by
    simulation (module docstring); the least-memory plan when no option fits a rank; None
    when ``cut(each rank's option)`` says the variant cannot beat the incumbent."""
    limits, p = case.limits, len(case.limits)
    over = _over(case.plain, limits)
    if cut([1 if r in over else 0 for r in range(p)]):  # each over rank's cheapest option
        return None
    peaks = option_peaks(case.schedule, case.cost,
                         [[o.plan for o in opts] for opts in case.options])
    fits = [[i for i, v in enumerate(pk) if v <= limits[r] + EPS]
            for r, pk in enumerate(peaks)]
    at = [0 if r not in over else fits[r][0] if fits[r] else 1 for r in range(p)]
    if cut(at):
        return None
    stages = case.schedule.placement.rank_stages
    if any(not fits[r] for r in over):
        split = {op.stage for ops in case.schedule.ranks for op in ops if op.kind == "B"}
        least = tuple(x for r in over for x in least_plan(case.cost, stages[r], split))
        met, sched = _run(case, least)
        if _over(met, limits):
            return least, met, sched
    while True:
        plan = tuple(x for r in range(p) for x in case.options[r][at[r]].plan)
        met, sched = _run(case, plan)
        still = _over(met, limits)
        if not still:
            return plan, met, sched
        for r in still:
            at[r] += 1
            if at[r] >= len(case.options[r]):
                return None  # the least-memory plan fitted: cannot happen
        if cut(at):
            return None


def _run(case: _Case, plan: Plan) -> tuple[Metrics, Schedule]:
    sched = recompute_stages(case.schedule, dict(plan))
    return simulate(sched, case.cost).metrics(), sched


def _over(met: Metrics, limits: Sequence[float]) -> list[int]:
    return [r for r, v in enumerate(met.peak_activation) if v > limits[r] + EPS]


def _beaten(bound: float, ctx: Context) -> bool:
    """Whether a variant whose span is at least ``bound`` cannot beat the incumbent."""
    if not ctx.prune or ctx.best is None:
        return False
    return bound >= ctx.key(ctx.best)[0] * (1 - EPS)  # span <= makespan: both are bounded


def _round_bound(case: _Case, at: list[int], objective: str) -> float:
    """A round's lower bound: each rank's work plus its option's priced time (``at``: each
    rank's option); at least the plain makespan where recompute delays nothing (module
    docstring) and the makespan ranks."""
    out = max(w + opts[i].extra for w, opts, i in zip(case.work, case.options, at, strict=True))
    monotone = not any(st.after_w for st in case.cost.stages)
    if monotone and objective == "makespan":
        out = max(out, case.plain.makespan)
    return out


def _trial(case: _Case, plan: Plan, met: Metrics, sched: Schedule, ctx: Context,
           bound: float, seconds: float) -> Trial:
    """The variant as a ranked trial with its ``RecomputeNote``."""
    ranks = sorted({case.schedule.placement.stage_rank[s] for s, _ in plan})
    extra = case.schedule.microbatches * sum(recompute_time(case.cost.stage(s), k) for s, k in plan)
    note = RecomputeNote(case.label, tuple(sorted(plan)),
                         max((case.plain.peak_activation[r] for r in ranks), default=0.0),
                         min((ctx.limits[r] for r in ranks), default=0.0), extra,
                         case.plain.makespan, met.makespan)
    tag = _plan_label(note.plan)
    trial = simulated(f"{case.label} +{tag}", case.family, case.schedule.placement.kind,
                      bound, sched.renamed(f"{case.schedule.name} +{tag}"), met, seconds)
    trial.recompute = note
    ctx.rank(trial)
    return trial


def _plan_label(plan: Plan) -> str:
    """``SR[0-1] R[3]``."""
    return " ".join(f"{k}[{stage_ranges([s for s, x in plan if x == k]).replace(', ', ',')}]"
                    for k in ("SR", "R") if any(x == k for _, x in plan))
