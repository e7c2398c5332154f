"""Repetends for the graph search: one micro-batch's passes placed by CP-SAT so that every
device's passes tile an interval T (its work per micro-batch) with no overlap modulo T, under
the memory limit (``dsl.block_exact``, with gangs starting together), then tiled over the
micro-batches. In the steady phase every device works without idle time: the period is T (8 for
Tessel's nn case, where list scheduling alone settles near 8.6). Two schedules per layout: the
plain tiling, and the tiling squeezed by the list scheduler (warm-up and cool-down filled).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block_exact import exact_block
from flexpipe.dsl.squeeze import squeeze
from flexpipe.errors import FlexPipeError
from flexpipe.graphs.model import GraphModel
from flexpipe.ir.schedule import Schedule
from flexpipe.search.costs import span_bound
from flexpipe.search.ranking import Ranking, simulated
from flexpipe.search.result import Trial
from flexpipe.sim.engine import simulate

EFFORT = 5.0  # CP-SAT deterministic seconds per layout


def repetend_schedules(model: GraphModel, m: int, limit: float) -> list[tuple[str, Schedule]]:
    """(label, schedule) for the plain and the squeezed tiling of the layout's repetend; none
    when CP-SAT is missing or finds no repetend within ``EFFORT``."""
    block = exact_block(model.placement, model.cost, limit, graph=model.graph, effort=EFFORT)
    if block is None:
        return []
    head = f"repetend@{model.layout} T={block.interval:g}"
    name = f"search:{model.name} {head}"
    out = [(head, block.schedule(m, name=name))]
    try:
        out.append((f"{head} squeezed", squeeze(block, m, model.cost, limit, name=name)))
    except FlexPipeError:
        pass  # the list scheduler cornered itself under the limit: the plain tiling stands
    return out


def repetend_trials(models: Sequence[GraphModel], m: int, ctx: Ranking) -> list[Trial]:
    """Every layout's repetend schedules, simulated and ranked."""
    out = []
    for gm in models:
        t0 = time.perf_counter()
        for label, schedule in repetend_schedules(gm, m, min(ctx.limits)):
            metrics = simulate(schedule, gm.cost).metrics()
            trial = simulated(label, "repetend", gm.layout, span_bound(gm.cost, gm.placement, m),
                              schedule, metrics, time.perf_counter() - t0)
            ctx.rank(trial)
            out.append(trial)
    return out


def steady_period(schedule: Schedule, cost: CostModel) -> float:
    """Time between consecutive micro-batches in the middle of the schedule: when micro-batch
    3m/4 is done (its last backward ends; weight gradients may be deferred to the end) minus
    when micro-batch m/4 is, over m/2 (m >= 4)."""
    trace = simulate(schedule, cost)
    done: dict[int, float] = {}
    for r, ops in enumerate(schedule.ranks):
        for op, end in zip(ops, trace.ends[r], strict=True):
            if op.kind in ("B", "BW"):
                done[op.mb] = max(done.get(op.mb, 0.0), end)
    m = schedule.microbatches
    a, b = m // 4, (3 * m) // 4
    return (done[b] - done[a]) / max(1, b - a)
