"""Optimality across placements: CP-SAT on every placement the search simulated, each warm
started from its best trial, solved whole (no windows). When every one is proven optimal, the
smallest optimum is the optimum over all those placements (split B/W backward, micro-batches in
order per stage, the search's memory limits); a fused-BW schedule is one whose W follows its B at
once, so it is covered too when T_BW = T_B + T_W and M_W <= M_B.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from flexpipe.cost.model import CostModel
from flexpipe.ir.placement import Placement
from flexpipe.search.exact import FULL_OPS, solve
from flexpipe.search.ranking import Ranking, simulated
from flexpipe.search.result import SearchResult, Trial
from flexpipe.sim.engine import simulate


def _per_placement(trials: Sequence[Trial]) -> dict[tuple[int, ...], Trial]:
    """The best simulated trial of every distinct placement (by stage -> rank map)."""
    out: dict[tuple[int, ...], Trial] = {}
    for t in trials:
        if t.schedule is None or t.span is None or t.status not in ("best", "slower"):
            continue
        key = t.schedule.placement.stage_rank
        if key not in out or t.span < (out[key].span or 0.0):
            out[key] = t
    return out


def prove_across(result: SearchResult, ctx: Ranking, fit: Callable[[Placement], CostModel],
                 time_limit: float) -> None:
    """Solve every searched placement exactly (``time_limit`` seconds each); record the
    verdict in ``result.exact["across"]`` and rank each solution as a trial."""
    verdicts: dict[str, dict[str, object]] = {}
    proven = True
    for trial in _per_placement(result.trials).values():
        sched = trial.schedule
        assert sched is not None
        label = f"{sched.placement.kind} x{sched.num_stages // sched.num_ranks}"
        if len(sched) > FULL_OPS or "B" not in sched.kinds():
            verdicts[label] = {"status": "too large or fused: not attempted"}
            proven = False
            continue
        cost = fit(sched.placement)
        t0 = time.perf_counter()
        report = solve(sched.placement, sched.microbatches, cost, ctx.limits,
                       time_limit=time_limit, hint=sched)
        verdicts[label] = {"status": report.status, "objective": report.objective,
                           "bound": report.bound}
        proven &= report.status == "OPTIMAL"
        if report.schedule is not None:
            metrics = simulate(report.schedule, cost).metrics()
            new = simulated(f"exact[{label}] from {trial.label}", "exact", trial.placement,
                            trial.bound, report.schedule.renamed(f"search:exact {label}"),
                            metrics, time.perf_counter() - t0)
            ctx.rank(new)
            result.trials.append(new)
    names = ", ".join(verdicts)
    claim = (f"proven optimal across the placements the search simulated ({names}): split B/W, "
             "micro-batches in order per stage, this memory limit" if proven and verdicts else
             f"not proven across placements ({names}): see each status")
    result.exact = {**(result.exact or {}), "across": verdicts, "across_claim": claim}
    result.best_trial = ctx.best
    result.best = ctx.best.schedule if ctx.best else None
