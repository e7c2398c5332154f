"""The last step of a plan: hand the winning stages and devices to the automated scheduler
(``flexpipe.search``), whose list-scheduler synthesis tries new orders under each device's
activation budget (its memory less the parameters it holds); the library families were tried
by the planner itself, and the cost-aware V generators' block packing is too slow to repeat
here at 16 and more devices. Only answers on the plan's
own stages (one stage per device) are taken, re-simulated on the plan's cost model."""

from __future__ import annotations

from flexpipe.errors import FlexPipeError
from flexpipe.plan.evaluate import Outcome
from flexpipe.plan.problem import Cluster
from flexpipe.search.engine import search
from flexpipe.sim.engine import simulate


def refine(cluster: Cluster, best: Outcome, candidates: int,
           seconds: float | None = None) -> Outcome | None:
    """A faster outcome with the same stages and devices, or None; the search tries at most
    ``candidates`` (its effort) within the optional ``seconds``."""
    cand, cost = best.candidate, best.cost
    p = len(cand.path)
    if cost.num_stages != p:
        return None
    limits = [cluster.devices[d].memory - cost.stage(r).params for r, d in enumerate(cand.path)]
    if min(limits) <= 0:
        return None
    try:
        result = search(cost, p, cand.m, limits, objective="makespan", max_seconds=seconds,
                        max_candidates=candidates, library=False)
    except FlexPipeError:
        return None
    schedule = result.best
    if schedule is None or schedule.num_stages != p:
        return None
    metrics = simulate(schedule, cost).metrics()
    fits = all(peak <= cluster.devices[d].memory * (1 + 1e-9)
               for peak, d in zip(metrics.peak_memory, cand.path, strict=True))
    if not fits or metrics.makespan >= best.makespan * (1 - 1e-9):
        return None
    # the candidate keeps its (one stage per device) family: its placement is the schedule's;
    # the plan names the schedule by the search's answer (Plan.schedule_name)
    return Outcome(cand, metrics.makespan, metrics.peak_memory, True,
                   schedule, cost)
