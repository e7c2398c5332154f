"""The paper's adaptive V over building blocks (``schedules.vblocks``, ``schedules.vrows``):
the adaptive curve at unit costs, the anchors with the 1.5B times, limits, and the row steps
against brute-force checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost import CostModel
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.placement import Placement
from flexpipe.schedules import registry
from flexpipe.schedules.vblocks import building_blocks, repeat, v_blocks
from flexpipe.schedules.vrows import compact, complete, fill_bubbles, peaks
from flexpipe.sim import simulate

TIMES_15B = (18.522, 18.086, 9.337, 0.601)  # the zero-bubble paper's Table 9, 1.5B, p = 8


def unit(p: int) -> CostModel:
    return CostModel.per_rank(Placement.vshape(p).stage_rank, p)


def curve(p: int, chunks: int, m: int) -> float:
    """The paper's adaptive-V bubble rate at ``chunks`` chunk activations (m micro-batches)."""
    b = 3 * p - 1 - 3 * chunks + max(3 * p, p + 1 + 2 * math.ceil(chunks / 2))
    return b / (6 * m + b)


@pytest.mark.parametrize("p", [3, 4, 5, 6])
def test_reaches_the_adaptive_curve_at_every_memory(p: int) -> None:
    m, cost = 3 * p, unit(p)
    for chunks in range(p + p % 2, 2 * p + 1):
        met = simulate(v_blocks(p, m, cost, mem_limit=chunks / 2), cost).metrics()
        assert met.bubble_rate == pytest.approx(curve(p, chunks, m), abs=1e-9), chunks
        assert max(met.peak_activation) <= chunks / 2 + 1e-9


def test_odd_p_has_no_block_at_p_chunks() -> None:
    with pytest.raises(InfeasibleError, match="fits 2.5 per rank"):
        v_blocks(5, 15, unit(5), mem_limit=2.5)


def test_v_min_with_the_papers_times_reaches_the_authors() -> None:
    """V-Min at p = 8 with the 1.5B times and T_comm: the authors' adaptive scheduler 0.2993."""
    f, b, w, comm = TIMES_15B
    cost = CostModel.per_rank(Placement.vshape(8).stage_rank, 8, f=f, b=b, w=w, comm=comm)
    met = simulate(registry.build("v-min", 8, 24, cost=cost), cost).metrics()
    assert met.bubble_rate <= 0.2993 + 5e-5
    assert max(met.peak_activation) <= 4 * 2 * cost.stage(0).act + 1e-9


@settings(max_examples=25, deadline=None)
@given(p=st.integers(2, 5), m=st.integers(1, 12), chunks=st.integers(2, 10),
       f=st.sampled_from([1.0, 1.5]), w=st.sampled_from([0.5, 1.0]))
def test_fits_its_limit_and_more_memory_is_never_worse(p: int, m: int, chunks: int, f: float,
                                                       w: float) -> None:
    cost = CostModel.per_rank(Placement.vshape(p).stage_rank, p, f=f, w=w)
    limit = chunks * cost.stage(0).act
    try:
        sched = v_blocks(p, m, cost, mem_limit=limit)
    except InfeasibleError:
        return
    met = simulate(sched, cost).metrics()
    assert max(met.peak_activation) <= limit + 1e-9
    more = simulate(v_blocks(p, m, cost, mem_limit=limit + cost.stage(0).act), cost).metrics()
    assert more.bubble_rate <= met.bubble_rate + 1e-12


def test_building_blocks_are_distinct_and_collision_free() -> None:
    blocks = building_blocks(4)
    assert len(blocks) == len(set(blocks)) > 0
    for block in blocks:
        assert all(len(set(row)) == 4 for row in block)
        assert block[0][0] == 0  # rank 0's F opens the period


def test_repeat_runs_every_pass_once_per_micro_batch_in_dependency_order() -> None:
    p, m = 4, 5
    for block in building_blocks(p)[:20]:
        rows = repeat(block, p, m)
        assert all(row.count(tok) == m for row in rows for tok in "FfBbWw")
        assert complete(rows, m)


def test_compact_keeps_orders_and_refuses_a_deadlock() -> None:
    rows = [list("F  f B b W w"), list(" F f B b W w")]  # p = 2, m = 1: a valid order
    tight = compact(rows)
    assert tight is not None and complete(tight, 1)
    assert [[t for t in r if t != " "] for r in tight] == [[t for t in r if t != " "]
                                                          for r in rows]
    assert compact([list("fFBbWw"), list("FfBbWw")]) is None  # rank 0's f waits for rank 1's
    # f, which waits for rank 1's F, which waits for rank 0's F, behind that f: deadlock


def test_fill_bubbles_never_raises_a_peak_nor_breaks_a_dependency() -> None:
    p, m = 4, 8
    for block in building_blocks(p)[:30]:
        rows = compact(repeat(block, p, m))
        assert rows is not None
        filled = fill_bubbles(rows)
        assert complete(filled, m)
        assert max(peaks(filled)) <= max(peaks(rows))


def test_bad_sizes_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="p=0"):
        v_blocks(0, 4)
    with pytest.raises(ConfigError, match="m=0"):
        v_blocks(2, 0)


def test_the_search_reaches_the_curve_above_p_8() -> None:
    """v-blocks is a search candidate wherever the library runs it (p <= 16): at p = 10,
    between V-Half's and 1F1B's memory, the search's frontier is on the adaptive curve (with
    v-blocks capped at p = 8 it was 0.004-0.045 above it)."""
    from flexpipe.schedules.vblocks import LIBRARY_MAX_P
    from flexpipe.search import search
    from flexpipe.search.space import VBLOCKS_MAX_P

    assert VBLOCKS_MAX_P == LIBRARY_MAX_P
    p, m, limit = 10, 30, 8.0
    res = search(None, p, m, limit, objective="span")
    assert res.best_trial is not None and res.best_trial.bubble_rate is not None
    assert res.best_trial.bubble_rate <= curve(p, int(2 * limit), m) + 5e-5
