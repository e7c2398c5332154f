"""The V family against the zero-bubble authors' anchors (issue 16), V-Half never worse than
V-Min, adaptive V within its limit, and a search frontier monotone in memory (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost import CostModel
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.schedules.vgreedy import v_adaptive
from flexpipe.schedules.vpattern import pattern_schedule, slot_table
from flexpipe.schedules.vshape import v_half, v_min, v_zb
from flexpipe.schedules.zero_bubble import zb_v
from flexpipe.search import search
from flexpipe.sim import simulate
from flexpipe.sim.validate import validate

TABLE9 = {"1.5B": (18.522, 18.086, 9.337, 0.601), "6.2B": (29.718, 29.444, 19.927, 0.527)}


def _v_cost(p: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, comm: float = 0.0,
            wact: float = 1.0) -> CostModel:
    return CostModel.per_rank(Placement.vshape(p).stage_rank, p, f=f, b=b, w=w, comm=comm,
                              wact=wact)


@pytest.mark.parametrize(("model", "anchor"), [("1.5B", 0.0703), ("6.2B", 0.0403)])
def test_zb_v_at_least_as_good_as_the_authors_greedy(model: str, anchor: float) -> None:
    """ZB-V built from the cost model (Table 9 times, p = 8, m = 24) reaches the zero-bubble
    authors' cost-aware ZB-V greedy at 1F1B's memory."""
    cost = _v_cost(8, *TABLE9[model])
    met = simulate(zb_v(8, 24, cost), cost).metrics()
    assert met.bubble_rate <= anchor + 5e-5
    assert max(met.peak_activation) <= 8 + 1e-9


def test_v_zb_at_least_as_good_as_adaptive_v_at_1f1b_memory() -> None:
    cost = _v_cost(8, *TABLE9["1.5B"])
    met = simulate(v_zb(8, 24, cost), cost).metrics()
    assert met.bubble_rate <= 0.0739 + 5e-5 and max(met.peak_activation) <= 8 + 1e-9


def test_adaptive_v_is_zero_bubble_at_1f1b_memory_and_2p_reaches_the_authors() -> None:
    """Unit costs at p M_B: exactly zero bubble; Table 9 1.5B times at 2p M_B with M_W = M_B/2:
    the authors' 0.0076."""
    for p in (2, 3, 4, 6):
        met = simulate(v_adaptive(p, 3 * p), _v_cost(p)).metrics()
        assert met.bubble_rate == pytest.approx(0.0, abs=1e-12)
    cost = _v_cost(8, *TABLE9["1.5B"], wact=0.5)
    met = simulate(v_adaptive(8, 24, cost, mem_limit=16.0), cost).metrics()
    assert met.bubble_rate <= 0.0076 + 5e-5


@settings(max_examples=12, deadline=None)
@given(p=st.integers(2, 6), extra=st.integers(0, 4), chunks=st.integers(0, 12),
       f=st.sampled_from([0.5, 1.0, 1.5]), w=st.sampled_from([0.5, 1.0]),
       comm=st.sampled_from([0.0, 0.05]))
def test_adaptive_v_stays_within_its_limit(p: int, extra: int, chunks: int, f: float, w: float,
                                           comm: float) -> None:
    """Whatever it is asked, adaptive V is a valid schedule within the limit, or a clear
    ConfigError when nothing fits."""
    from flexpipe.errors import ConfigError

    m, cost = 2 * p + extra, _v_cost(p, f=f, w=w, comm=comm)
    limit = 0.5 * (p + chunks % (p + 1))
    try:
        sched = v_adaptive(p, m, cost, mem_limit=limit)
    except ConfigError as exc:
        assert "adaptive V" in str(exc)
        return
    assert validate(sched) == []
    assert max(simulate(sched, cost).metrics().peak_activation) <= limit + 1e-9


@pytest.mark.parametrize("name", ["v-min", "v-half"])
@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_fixed_patterns_are_valid_and_take_six_slots_per_micro_batch(name: str, p: int) -> None:
    slots = slot_table(name, p, 3 * p)
    for r in range(p):  # no two passes of a rank share a slot
        mine = [t for op, t in slots.items() if Placement.vshape(p).stage_rank[op.stage] == r]
        assert len(mine) == len(set(mine)) == 6 * 3 * p
    assert validate(pattern_schedule(name, p, 3 * p)) == []


@settings(max_examples=8, deadline=None)
@given(p=st.integers(2, 5), extra=st.integers(0, 3), f=st.sampled_from([1.0, 2.0]),
       b=st.sampled_from([1.0, 1.5]), w=st.sampled_from([0.5, 1.0]),
       comm=st.sampled_from([0.0, 0.1]))
def test_v_half_never_worse_than_v_min(p: int, extra: int, f: float, b: float, w: float,
                                       comm: float) -> None:
    m, cost = 2 * p + extra, _v_cost(p, f=f, b=b, w=w, comm=comm)
    half = simulate(v_half(p, m, cost), cost).metrics()
    low = simulate(v_min(p, m, cost), cost).metrics()
    assert half.bubble_rate <= low.bubble_rate + 1e-9
    assert max(half.peak_activation) <= (p + 2) // 2 + 1e-9


@settings(max_examples=6, deadline=None)
@given(p=st.integers(2, 4), extra=st.integers(0, 2), steps=st.tuples(
    st.integers(1, 8), st.integers(1, 8)), f=st.sampled_from([1.0, 2.0]),
    wact=st.sampled_from([1.0, 0.5]))
def test_search_frontier_is_monotone_in_memory(p: int, extra: int, steps: tuple[int, int],
                                               f: float, wact: float) -> None:
    """More memory never gives a worse search result (linear, V and interleaved placements)."""
    lo, hi = sorted(steps)
    cost = CostModel.uniform(p, p, f=f, wact=wact)
    m = 2 * p + extra
    spans = []
    for eighths in (lo, hi + 1):
        res = search(cost, p, m, p * (4 + eighths) / 8, objective="span")
        spans.append(res.best_trial.span if res.best_trial else float("inf"))
    assert spans[1] <= spans[0] + 1e-9


@pytest.mark.parametrize(("p", "limit", "at_most"), [(4, 3.5, 0.0526), (6, 4.5, 0.0769)])
def test_search_uses_memory_above_v_half_in_its_warm_up_and_cool_down(
        p: int, limit: float, at_most: float) -> None:
    """Between V-Half's and 1F1B's memory the search's V-Half pattern squeezed under the limit
    beats V-Half itself (unit costs, m = 3p), and its schedule fits the limit."""
    cost = _v_cost(p)
    res = search(cost, p, 3 * p, limit, objective="span")
    assert res.best_trial is not None and res.best_trial.bubble_rate <= at_most + 5e-5
    assert res.best_trial.bubble_rate < simulate(v_half(p, 3 * p)).metrics().bubble_rate
    assert max(simulate(res.best, cost).metrics().peak_activation) <= limit + 1e-9


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["v-min", "v-half"]), st.integers(2, 10), st.integers(2, 30))
def test_slot_squeeze_keeps_dependencies_slots_and_the_patterns_peak(
        name: str, p: int, m: int) -> None:
    """The paper's squeeze on the slot table: one pass per slot per rank, every pass after the
    passes it reads, every pass of the pattern kept, the unit peak within the pattern's; its
    slot order is a valid schedule."""
    from flexpipe.schedules.vslots import squeeze_slots

    table = slot_table(name, p, m)
    out = squeeze_slots(table, p, m)
    roomier = squeeze_slots(table, p, m, limit=2 * p)  # more room: still every pass, once
    assert set(roomier) == set(table)
    assert set(out) == set(table)
    pl = Placement.vshape(p)
    seen = {(pl.stage_rank[op.stage], t) for op, t in out.items()}
    assert len(seen) == len(out)
    for op, t in out.items():
        if op.kind == "F" and op.stage > 0:
            assert out[Op("F", op.stage - 1, op.mb)] < t
        if op.kind == "B":
            nxt = ("B", op.stage + 1) if op.stage < 2 * p - 1 else ("F", op.stage)
            assert out[Op(*nxt, op.mb)] < t
        if op.kind == "W":
            assert out[Op("B", op.stage, op.mb)] < t
    cost = _v_cost(p)
    sched = pattern_schedule(name, p, m, cost)
    assert validate(sched) == []
    unit = {"F": 1, "B": 0, "W": -1}

    def peak(slots: dict[Op, int]) -> int:
        mem, top = [0] * p, 0
        for op in sorted(slots, key=slots.__getitem__):
            r = pl.stage_rank[op.stage]
            mem[r] += unit[op.kind]
            top = max(top, mem[r])
        return top

    assert peak(out) <= peak(table)
