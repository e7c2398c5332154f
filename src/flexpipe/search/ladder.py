"""A memory/bubble frontier that is monotone: more memory never gives a worse search result.

The library's families keep their own limits (they fit or not), but the limit-driven
candidates -- the list scheduler's knobs and adaptive V, built *for* the memory limit -- can do
worse with more memory (a greedy that may hoard more forwards can corner itself). So the search
also builds each limit-driven candidate at every rung of a ladder below the limit: multiples of
the memory quantum q of its placement's cost model (the smallest positive act, wact or
act - wact of a stage), from one micro-batch per rank up to the limit. When every memory change
is a multiple of q (uniform stages, M_W = M_B or M_B / 2, ...) a candidate built for a limit L
is the one built for floor(L / q) q, so a schedule found at L is also found at any L' > L.

The ladder runs for p <= ``LADDER_MAX_P`` (16: every p the building-block scheduler
``v-blocks`` is a candidate at) and at most ``MAX_RUNGS`` rungs (so profiled costs with a tiny
quantum are not ladder-searched), and only when the search has no effort budget. Where it does
not run, ``search.frontier`` keeps the frontier monotone by construction: it searches the
limits in ascending order and seeds each with the winner below.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from flexpipe.cost.model import CostModel
from flexpipe.ir.placement import Placement
from flexpipe.search.costs import rank_mb_act
from flexpipe.search.result import Trial
from flexpipe.search.space import VBLOCKS_MAX_P, Candidate

LADDER_MAX_P = VBLOCKS_MAX_P
MAX_RUNGS = 48
EPS = 1e-9
Evaluate = Callable[[Candidate, float], Trial]


def quantum(cost: CostModel) -> float:
    """The smallest positive memory change of one pass on any stage (act, wact, act - wact)."""
    amounts = [x for st in cost.stages for x in (st.act, st.wact, abs(st.act - st.wact))
               if x > EPS]
    return min(amounts, default=0.0)


def rungs(cost: CostModel, placement: Placement, limit: float) -> list[float]:
    """The ladder below ``limit`` for ``placement``: multiples of the quantum from one
    micro-batch per rank up to, not including, the rung ``limit`` falls on; [] when there are
    more than ``MAX_RUNGS``."""
    q = quantum(cost)
    if q <= 0:
        return []
    low = math.ceil(max(rank_mb_act(cost, placement)) / q - EPS)
    top = math.floor(limit / q + EPS)
    if top - low > MAX_RUNGS:
        return []
    return [k * q for k in range(max(low, 1), top)]


def limit_driven(cand: Candidate) -> bool:
    """Whether the candidate is built for the memory limit (list scheduler, adaptive V)."""
    return cand.family == "policy"


def ladder_trials(space: Sequence[Candidate], p: int, limits: Sequence[float],
                  fitted: Callable[[Candidate], tuple[CostModel, Placement] | None],
                  evaluate: Evaluate) -> list[Trial]:
    """Every limit-driven candidate of ``space`` evaluated at each rung below the smallest
    per-rank limit (``evaluate(cand, level)``); only simulated trials are kept."""
    if p > LADDER_MAX_P:
        return []
    out = []
    for cand in space:
        got = fitted(cand) if limit_driven(cand) else None
        if got is None:
            continue
        for level in rungs(*got, min(limits)):
            trial = evaluate(cand, level)
            if trial.schedule is not None:
                out.append(trial)
    return out
