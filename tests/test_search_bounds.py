"""The search's pruning rules (``flexpipe.search.bounds``) and cool-down polish
(``flexpipe.search.polish``): the warm-up bound never exceeds a simulated span, its closed form
on the linear placement, the dominance rule's reach, pruning that keeps the best, and a polish
that only ever lowers the objective within the memory limit."""

from __future__ import annotations

import pytest

from flexpipe.cost import CostModel
from flexpipe.ir.placement import Placement
from flexpipe.schedules.registry import build, library
from flexpipe.search import fit_cost, search
from flexpipe.search.bounds import dominated, fill_bound, forward_only_warmup, warmup_applies
from flexpipe.search.costs import rank_work
from flexpipe.search.polish import polish
from flexpipe.search.space import Candidate
from flexpipe.sim import simulate
from flexpipe.sim.validate import validate

TIMES = {"unit": (1.0, 1.0, 1.0, 0.0), "1.5B": (18.522, 18.086, 9.337, 0.601)}


def _cost(times: str, p: int, wact: float = 0.5) -> CostModel:
    f, b, w, c = TIMES[times]
    return CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=wact, comm=c)


@pytest.mark.parametrize("times", sorted(TIMES))
@pytest.mark.parametrize("p", [2, 4, 6])
def test_warmup_bound_never_exceeds_a_simulated_span(times: str, p: int) -> None:
    """Every library schedule the rule covers, at its own peak memory as the limit."""
    m = 3 * p
    for name, entry in library().items():
        if not forward_only_warmup(name, ()):
            continue
        try:
            placement = entry.placement_for(p)
        except Exception:  # noqa: BLE001 - a family without a placement for this p
            continue
        cost = fit_cost(_cost(times, p), placement.num_stages)
        kw = {"cost": cost} if entry.cost_aware else {}
        sched = build(name, p, m, **kw)
        met = simulate(sched, cost).metrics()
        bound = fill_bound(cost, placement, m, met.peak_activation)
        assert bound <= max(met.span) + 1e-9, (name, bound, max(met.span))
        assert bound >= max(rank_work(cost, placement, m)) - 1e-9


def test_warmup_bound_on_the_linear_placement_is_its_closed_form() -> None:
    """At p M_B rank 0 idles at least (p - 1)(T_B + 2 T_comm) before its first backward."""
    p, m = 8, 24
    f, b, w, c = TIMES["1.5B"]
    cost = _cost("1.5B", p)
    bound = fill_bound(cost, Placement.linear(p), m, [float(p)] * p)
    assert bound == pytest.approx(m * (f + b + w) + (p - 1) * (b + 2 * c))
    assert fill_bound(cost, Placement.linear(p), m, [2.0 * p] * p) == pytest.approx(
        m * (f + b + w))  # 2p forwards cover the round trip: only the work is left


def test_recompute_families_are_not_bounded_by_the_warmup_rule() -> None:
    assert not forward_only_warmup("1f1b-recompute", ())
    assert not forward_only_warmup("1f1b-offload", ())
    assert forward_only_warmup("zb-h1", ())
    assert warmup_applies(Candidate("policy", (("ahead", "1p"),), "linear", 1))


def test_dominance_only_above_one_f_one_b_memory() -> None:
    p = 8
    cost = fit_cost(_cost("1.5B", p), 2 * p)
    vs = Placement.vshape(p)
    half = Candidate("v-half", (), "2-chunk", 2)
    pattern = Candidate("policy", (("builder", "v-pattern"),), "vshape", 2)
    zbv = Candidate("zb-v", (), "2-chunk", 2)
    assert dominated(half, [8.0] * p, cost, vs) and dominated(pattern, [16.0] * p, cost, vs)
    assert not dominated(half, [7.5] * p, cost, vs)
    assert not dominated(zbv, [8.0] * p, cost, vs)


@pytest.mark.parametrize("p, m, factor", [
    (4, 12, 1), pytest.param(8, 24, 1, marks=pytest.mark.slow), (8, 24, 2)])
def test_pruning_keeps_the_best(p: int, m: int, factor: int) -> None:
    """Measured evidence for the rules, as a test: the pruned search finds the full one's best.
    CI runs 1F1B's memory at p = 4 and twice it at p = 8; 1F1B's memory at p = 8 (the unpruned
    search alone takes about 20 s) is ``slow``."""
    cost = _cost("1.5B", p)
    full = search(cost, p, m, factor * p, prune=False)
    pruned = search(cost, p, m, factor * p)
    assert pruned.best_trial is not None and full.best_trial is not None
    assert pruned.best_trial.makespan <= full.best_trial.makespan + 1e-9
    assert pruned.counts().get("pruned (bound)", 0) + pruned.counts().get(
        "pruned (dominated)", 0) > 0


def test_polish_lowers_zb_v_makespan_within_memory() -> None:
    p, m = 4, 8
    cost = fit_cost(_cost("1.5B", p), 2 * p)
    sched = build("zb-v", p, m, cost=cost)
    before = simulate(sched, cost).metrics()
    limits = [float(p)] * p
    found = polish(sched, cost, limits, lambda met: (met.makespan, max(met.span)))
    assert found is not None
    polished, met = found
    assert met.makespan < before.makespan
    assert validate(polished, cost, mem_limit=limits) == []


def test_makespan_is_the_default_objective() -> None:
    p, m = 4, 8
    cost = _cost("1.5B", p)
    default = search(cost, p, m, float(p))
    span = search(cost, p, m, float(p), objective="span")
    assert default.best_trial is not None and span.best_trial is not None
    assert default.best_trial.makespan <= span.best_trial.makespan + 1e-9
    assert "largest per-rank span" in default.bubble_definition
