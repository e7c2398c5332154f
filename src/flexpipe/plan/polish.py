"""Local search on the winning plan's cuts, judged by the simulator: move one stage boundary by
one layer at a time while that makes the simulated iteration faster and still fits memory.
The dynamic programming optimises a formula; this step corrects what the formula misses (where
the heavier stages sit, how the schedule fills its bubbles)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

from flexpipe.cost.partition import boundary_moves
from flexpipe.plan.evaluate import Outcome, simulate_candidate
from flexpipe.plan.problem import Cluster, Model


def polish(model: Model, cluster: Cluster, best: Outcome, sims_budget: int,
           seconds: float | None = None) -> tuple[Outcome, int]:
    """The best outcome found by first-improvement boundary moves within ``sims_budget``
    simulations (the effort: the same answer on any machine) and, when given, ``seconds``
    (an optional wall-clock limit), and the number of simulations it took."""
    deadline = math.inf if seconds is None else time.perf_counter() + seconds
    sims, improved = 0, True
    while improved and sims < sims_budget and time.perf_counter() < deadline:
        improved = False
        for cuts in boundary_moves(best.candidate.cuts):
            if sims >= sims_budget or time.perf_counter() >= deadline:
                break
            sims += 1
            out = simulate_candidate(model, cluster, replace(best.candidate, cuts=cuts))
            if out is not None and out.fits and out.makespan < best.makespan * (1 - 1e-9):
                best, improved = out, True
                break
    return best, sims
