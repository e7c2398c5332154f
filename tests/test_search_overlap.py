"""The search and overlapped schedules: with a cost whose passes carry large communication
parts (``F_COMM``, ``BW_COMM``: what an overlapped pair hides) it picks an overlapped schedule
(DualPipeV); without them it prefers a zero-bubble one; and its pruning bound stays a bound
when pairs can hide communication (``search.costs.stage_floor``)."""

from __future__ import annotations

import pytest

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.ir.placement import Placement
from flexpipe.schedules.registry import build, library
from flexpipe.search import fit_cost, search, span_bound
from flexpipe.search.space import library_candidates
from flexpipe.sim.engine import simulate


def _cost(p: int, comm: float) -> CostModel:
    """p stages of F = B = W = 1 whose F and fused backward spend ``comm`` of their time (and
    twice that) in communication."""
    times = {"F": 1.0, "B": 1.0, "W": 1.0, "F_COMM": comm, "BW_COMM": 2 * comm,
             "B_COMM": comm, "W_COMM": comm}
    return CostModel((StageCost(times, act=1.0, wact=0.5),) * p, Comm.uniform(p))


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16)])
def test_large_communication_picks_an_overlapped_schedule(p: int, m: int) -> None:
    result = search(_cost(p, 0.6), p, m, 100.0, synthesis=False)
    assert result.best is not None and result.best.overlaps, result.best
    flat = simulate(result.best.flattened(), fit_cost(_cost(p, 0.6), 2 * p)).metrics()
    best = next(t for t in result.trials if t.status == "best")
    assert best.makespan is not None and best.makespan < flat.makespan


@pytest.mark.parametrize("p,m", [(2, 8), (4, 16)])
def test_without_communication_an_overlapped_schedule_is_not_preferred(p: int, m: int) -> None:
    result = search(_cost(p, 0.0), p, m, 100.0, synthesis=False)
    assert result.best is not None and not result.best.overlaps, result.best.name
    tried = {t.family: t for t in result.trials}
    assert tried["dualpipev"].status in ("slower", "pruned (bound)")


@pytest.mark.parametrize("comm", [0.0, 0.3, 0.6, 1.0])
def test_the_span_bound_holds_under_overlap(comm: float) -> None:
    """No schedule beats the bound: DualPipeV's pairs hide communication, so the bound counts
    each pass's compute alone where the cost gives communication parts."""
    p, m = 4, 8
    cost = fit_cost(_cost(p, comm), 2 * p)
    metrics = simulate(build("dualpipev", p, m), cost).metrics()
    assert span_bound(cost, Placement.vshape(p), m) <= max(metrics.span) + 1e-9


def test_dualpipe_is_left_to_its_own_cost_and_dualpipev_enters() -> None:
    """DualPipe's stages are two copies of the one-per-rank cut, m counted per direction:
    the chain search does not try it (``Entry.searched``); DualPipeV is a candidate."""
    families = {c.family for c in library_candidates(4)}
    assert "dualpipev" in families and "dualpipe" not in families
    assert not library()["dualpipe"].searched
