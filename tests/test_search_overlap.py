"""The search and overlapped schedules: with a cost whose passes carry large communication
parts (``F_COMM``, ``BW_COMM``: what an overlapped pair hides) it picks an overlapped schedule
(DualPipeV); without them it prefers a zero-bubble one; its pruning bound stays a bound
when pairs can hide communication (``search.costs.stage_floor``); DualPipe is tried on its
own terms (two copies of the cut, half the micro-batches per direction)."""

from __future__ import annotations

import pytest

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.ir.placement import Placement
from flexpipe.schedules.registry import build
from flexpipe.search import fit_cost, search, span_bound
from flexpipe.search.costs import fit_placement
from flexpipe.search.result import SearchResult
from flexpipe.search.space import library_candidates
from flexpipe.sim.engine import simulate


def _cost(p: int, comm: float) -> CostModel:
    """p stages of F = B = W = 1 whose F and fused backward spend ``comm`` of their time (and
    twice that) in communication."""
    times = {"F": 1.0, "B": 1.0, "W": 1.0, "F_COMM": comm, "BW_COMM": 2 * comm,
             "B_COMM": comm, "W_COMM": comm}
    return CostModel((StageCost(times, act=1.0, wact=0.5),) * p, Comm.uniform(p))


def _gain(result: SearchResult, cost: CostModel) -> float:
    """How much longer the search's best runs with its pairs taken apart (0: they gain
    nothing)."""
    best = next(t for t in result.trials if t.status == "best")
    assert best.schedule is not None and best.makespan is not None
    fitted = fit_placement(cost, best.schedule.placement)
    return simulate(best.schedule.flattened(), fitted).metrics().makespan - best.makespan


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16)])
def test_large_communication_picks_an_overlapped_schedule(p: int, m: int) -> None:
    result = search(_cost(p, 0.6), p, m, 100.0, synthesis=False)
    assert result.best is not None and result.best.overlaps, result.best
    assert _gain(result, _cost(p, 0.6)) > 0


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16)])
def test_without_communication_an_overlapped_schedule_is_not_preferred(p: int, m: int) -> None:
    """Without communication parts a pair hides nothing: DualPipeV loses to the zero-bubble
    schedules, and whatever wins gains nothing from pairs (DualPipe at p = 2 wins by its
    bubble-free order, (p/2 - 1) = 0, not by overlap)."""
    result = search(_cost(p, 0.0), p, m, 100.0, synthesis=False)
    assert result.best is not None
    assert _gain(result, _cost(p, 0.0)) == pytest.approx(0.0)
    tried = {t.family: t for t in result.trials}
    assert tried["dualpipev"].status in ("slower", "pruned (bound)")
    assert result.best.overlaps == frozenset() or result.best.name == "dualpipe"


@pytest.mark.parametrize("comm", [0.0, 0.3, 0.6, 1.0])
def test_the_span_bound_holds_under_overlap(comm: float) -> None:
    """No schedule beats the bound: DualPipeV's pairs hide communication, so the bound counts
    each pass's compute alone where the cost gives communication parts."""
    p, m = 4, 8
    cost = fit_cost(_cost(p, comm), 2 * p)
    metrics = simulate(build("dualpipev", p, m), cost).metrics()
    assert span_bound(cost, Placement.vshape(p), m) <= max(metrics.span) + 1e-9


def test_dualpipe_is_searched_on_two_copies_of_the_cut_with_half_the_micro_batches() -> None:
    """DualPipe's stages are two copies of the one-per-rank cut (stage p + k is stage k again)
    and each direction takes m / 2 micro-batches: its trial is that schedule on that cost, and
    an odd m leaves it out with the reason."""
    p, m = 4, 16
    cost = _cost(p, 0.6)
    tried = {t.family: t for t in search(cost, p, m, 100.0, synthesis=False).trials}
    mirrored = CostModel(cost.stages + cost.stages, cost.comm)
    want = simulate(build("dualpipe", p, m // 2), mirrored).metrics().makespan
    assert tried["dualpipe"].makespan == pytest.approx(want)
    assert tried["dualpipe"].schedule is not None
    assert tried["dualpipe"].schedule.microbatches == m // 2
    odd = {t.family: t for t in search(cost, p, m + 1, 100.0, synthesis=False).trials}
    assert odd["dualpipe"].status == "invalid" and "must be even" in odd["dualpipe"].reason
    assert {"dualpipe", "dualpipev"} <= {c.family for c in library_candidates(p)}
