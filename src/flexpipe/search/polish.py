"""Polish the cool-down of the search's best schedule: where each rank puts its weight gradients
(W) after its last forward decides how long the others wait for the last input gradients, and
constructions that place them by a rule (W fills idle time, W after its B) leave a few time
units on the table: torch's ZBVZeroBubble order at p = 4 ends 0.12% sooner than ZB-V's rules.

Hill climbing over adjacent swaps: on every rank, a W of the cool-down (after the rank's last
forward) trades places with the pass before or after it (never its own B), and the swap is kept
when the simulated objective (makespan, then span) falls and every rank stays within its memory
limit. Sweeps repeat until none helps or the effort budget (simulated ops) is spent; the
budget is a count, so the answer does not depend on the machine's load.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from flexpipe.cost.model import CostModel
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.engine import simulate
from flexpipe.sim.trace import Metrics

BUDGET_OPS = 250_000  # simulated ops spent at most (ZB-V at p = m = 18: 128 simulations)
EPS = 1e-9
Score = Callable[[Metrics], tuple[float, ...]]


def polish(schedule: Schedule, cost: CostModel, limits: Sequence[float], score: Score,
           budget_ops: int = BUDGET_OPS) -> tuple[Schedule, Metrics] | None:
    """A schedule with a better ``score`` than ``schedule``'s, found by moving cool-down W
    passes (module docstring), and its metrics; None when no move helps within the budget."""
    ranks = [list(ops) for ops in schedule.ranks]
    best = simulate(schedule, cost).metrics()
    start = score(best)
    sims = max(1, budget_ops // max(1, len(schedule)))
    improved = True
    while improved and sims > 0:
        improved = False
        for r, i, k in _moves(ranks):
            if sims <= 0:
                break
            sims -= 1
            trial = [*ranks[:r], _moved(ranks[r], i, k), *ranks[r + 1:]]
            met = _fits(schedule.with_ranks(trial), cost, limits)
            if met is not None and score(met) < score(best):
                best, improved, ranks = met, True, trial
                break  # positions changed: list the moves again
    if not score(best) < start:
        return None
    return schedule.with_ranks(ranks), best


def _moved(ops: list[Op], i: int, k: int) -> list[Op]:
    """``ops`` with the op at i moved to position k."""
    out = ops[:i] + ops[i + 1:]
    out.insert(k, ops[i])
    return out


def _moves(ranks: list[list[Op]]) -> list[tuple[int, int, int]]:
    """(rank, i, k): move the cool-down W at position i to position k, anywhere after the
    rank's last forward and after its own B."""
    out = []
    for r, ops in enumerate(ranks):
        where = {op: k for k, op in enumerate(ops)}
        last_f = max((k for k, op in enumerate(ops) if op.kind == "F"), default=-1)
        for i in range(last_f + 1, len(ops)):
            op = ops[i]
            if op.kind != "W":
                continue
            low = max(last_f, where.get(Op("B", op.stage, op.mb), -1)) + 1
            out += [(r, i, k) for k in range(low, len(ops)) if k != i]
    return out


def _fits(schedule: Schedule, cost: CostModel, limits: Sequence[float]) -> Metrics | None:
    """The metrics of ``schedule`` when every rank stays within its limit, else None."""
    met = simulate(schedule, cost).metrics()
    if any(v > lim + EPS for v, lim in zip(met.peak_activation, limits, strict=True)):
        return None
    return met
