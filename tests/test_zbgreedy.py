"""The zero-bubble paper's heuristic (``schedules.zbgreedy``) against the paper's own Table 5
bubble rates at ZB-1p and ZB-2p (Table 9 times), valid and within its limit on random inputs,
found by the search on the linear placement, and bad input refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.schedules.zbgreedy import zb_greedy
from flexpipe.search import search
from flexpipe.sim import simulate
from flexpipe.sim.validate import validate

# model: p, m, T_F, T_B, T_W, T_comm, ZB-1p, ZB-2p (docs/facts.md)
TABLE9 = {"1.5B": (8, 24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433),
          "6.2B": (8, 24, 29.718, 29.444, 19.927, 0.527, 0.1323, 0.0029),
          "14.6B": (16, 48, 11.347, 11.248, 8.132, 0.377, 0.1397, 0.0066),
          "28.3B": (32, 96, 10.419, 10.207, 7.715, 0.408, 0.1421, 0.0038)}


def _cost(model: str) -> CostModel:
    p, _m, f, b, w, comm, _z1, _z2 = TABLE9[model]
    return CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=0.5, comm=comm)


@pytest.mark.parametrize("model", sorted(TABLE9))
def test_reproduces_the_papers_zb_1p_and_zb_2p(model: str) -> None:
    p, m, *_, zb1, zb2 = TABLE9[model]
    cost = _cost(model)
    for factor, paper in ((1, zb1), (2, zb2)):
        sched = zb_greedy(p, m, cost, mem_limit=factor * p)
        met = simulate(sched, cost).metrics()
        assert validate(sched) == []
        assert met.bubble_rate == pytest.approx(paper, abs=5e-5), (model, factor)
        assert max(met.peak_activation) <= factor * p + 1e-9


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 8), m=st.integers(1, 40), data=st.data())
def test_uneven_stages_are_valid_and_within_the_limit_or_infeasible(
        p: int, m: int, data: st.DataObject) -> None:
    """Stages of different times and memory (a planner's cut: found this way, the warm-up once
    gave a stage more forwards than the stage before it had made)."""
    acts = data.draw(st.lists(st.sampled_from([0.25, 1.0, 4.0]), min_size=p, max_size=p))
    fs = data.draw(st.lists(st.sampled_from([0.25, 1.0, 3.0]), min_size=p, max_size=p))
    stages = tuple(StageCost({"F": f, "B": f * 1.1, "W": f * 0.8}, act=a, wact=a / 2)
                   for f, a in zip(fs, acts, strict=True))
    cost = CostModel(stages, Comm.uniform(p, 0.1))
    limit = data.draw(st.sampled_from([1.0, 4.0, 16.0, 64.0, 200.0]))
    try:
        sched = zb_greedy(p, m, cost, mem_limit=limit)
    except InfeasibleError:
        assert limit < m * max(acts)  # room for every micro-batch: it always finds one
        return
    assert validate(sched) == []
    assert max(simulate(sched, cost).metrics().peak_activation) <= limit + 1e-9


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 14), f=st.sampled_from([1.0, 1.5, 2.0]),
       w=st.sampled_from([0.5, 1.0]), wact=st.sampled_from([0.5, 1.0]),
       limit=st.sampled_from([0.5, 1.0, 1.5, 2.0]), comm=st.sampled_from([0.0, 0.3]))
def test_valid_and_within_its_limit_or_infeasible(p: int, m: int, f: float, w: float,
                                                  wact: float, limit: float,
                                                  comm: float) -> None:
    """Any p, m, pass times and limit (in multiples of p M_B): a valid schedule within the
    limit, or InfeasibleError, nothing else."""
    cost = CostModel.uniform(p, p, f=f, w=w, wact=wact, comm=comm)
    try:
        sched = zb_greedy(p, m, cost, mem_limit=limit * p)
    except InfeasibleError:
        return
    assert validate(sched) == []
    assert max(simulate(sched, cost).metrics().peak_activation) <= limit * p + 1e-9


def test_the_search_on_the_linear_placement_meets_zb_2p() -> None:
    res = search(_cost("1.5B"), 8, 24, 16, placements=("linear",), objective="span")
    assert res.best_trial is not None and res.best_trial.bubble_rate is not None
    assert res.best_trial.bubble_rate <= 0.0433 + 5e-5
    assert all(t.placement == "linear" for t in res.trials if t.status in ("best", "slower"))


@pytest.mark.parametrize(("args", "message"), [
    ((0, 4), "positive integers"), ((2, 4, CostModel.uniform(3, 3)), "3 stages, not p=2"),
])
def test_bad_input_is_refused_by_name(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        zb_greedy(*args)  # type: ignore[arg-type]
