"""DualPipe's cost from the V's: a model cut into the V's four stages (V stage s on rank
min(s, 3 - s)) predicts DualPipe's two model stages when each of those is the V stages that
hold its layers, merged (``fit_placement``; the cuts nest: ``split_counts``), and the share a
pair hides (``PAIR_HIDE``) merges as a share, weighed by what each part can hide, not added."""

from __future__ import annotations

import itertools

import pytest

from flexpipe.cost.model import CostModel, StageCost, merge_stages
from flexpipe.errors import ConfigError
from flexpipe.ir.overlap import HIDE_SHARE
from flexpipe.schedules.dualpipe_twoway import model_stage, two_way_placement
from flexpipe.schedules.registry import build
from flexpipe.search.costs import _scaled, fit_cost, fit_placement, split_counts
from flexpipe.sim.engine import simulate


def _stage(f: float, **extra: float) -> StageCost:
    """A stage of F = f (no communication unless ``extra`` gives it)."""
    return StageCost({"F": f, "B": 2 * f, "W": f, "B_COMM": 0.0, "BW_COMM": 0.0, **extra})


def _cuts(counts: list[int]) -> set[int]:
    return set(itertools.accumulate(counts))


def test_the_v_cut_nests_in_the_two_stage_cut() -> None:
    assert split_counts([3, 3], 2) == [2, 1, 2, 1]
    assert split_counts([4, 3], 2) == [2, 2, 2, 1]
    for coarse in ([3, 3], [4, 3], [5, 2]):
        fine = split_counts(coarse, 2)
        assert _cuts(coarse) <= _cuts(fine) and sum(fine) == sum(coarse)
    # ranks of the V (stage s on rank min(s, 3 - s)) hold what the even cut gives them
    v = split_counts([3, 3], 2)
    assert (v[0] + v[3], v[1] + v[2]) == (3, 3)
    with pytest.raises(ConfigError, match="into 2 chunks"):
        split_counts([3, 1], 2)


def test_dualpipe_model_stage_k_is_the_v_stages_holding_its_layers() -> None:
    v = CostModel(tuple(_stage(f) for f in (1.0, 2.0, 4.0, 8.0)), CostModel.uniform(2, 2).comm)
    placement = two_way_placement(2)
    two_way = fit_placement(v, placement)
    halves = (merge_stages(v.stages[0:2]), merge_stages(v.stages[2:4]))
    assert two_way.stages == tuple(halves[model_stage(s, 2)] for s in range(4))
    assert [st.time("F") for st in two_way.stages] == [3.0, 12.0, 3.0, 12.0]
    assert fit_cost(v, 2).stages == halves  # 1F1B's two stages alike
    dual = build("dualpipe", 2, 4)
    assert simulate(dual, two_way).metrics().makespan > 0


def test_merging_weighs_the_pair_share_by_the_hideable_time() -> None:
    a = _stage(1.0, BW_COMM=1.0, B_COMM=0.5, **{HIDE_SHARE: 0.2})
    b = _stage(1.0, B_COMM=3.0, BW_COMM=2.5, **{HIDE_SHARE: 0.8})
    merged = merge_stages([a, b])  # hideable: 1 (BW's) and 3 (B's)
    assert merged.time(HIDE_SHARE) == pytest.approx((0.2 * 1 + 0.8 * 3) / 4)
    assert merged.time("BW_COMM") == 3.5 and merged.time("F") == 2.0
    # a part with nothing to hide (an embedding) does not move the share
    assert merge_stages([_stage(0.5), a]).time(HIDE_SHARE) == pytest.approx(0.2)
    # nothing to hide anywhere: the plain mean of the shares (1 where a part gives none)
    assert merge_stages([_stage(1.0, **{HIDE_SHARE: 0.5}), _stage(1.0)]).time(HIDE_SHARE) \
        == pytest.approx(0.75)
    assert HIDE_SHARE not in merge_stages([_stage(1.0), _stage(2.0)]).times


def test_scaling_a_stage_keeps_its_share() -> None:
    a = _stage(2.0, BW_COMM=1.0, **{HIDE_SHARE: 0.4})
    half = _scaled(a, 0.5)
    assert half.time(HIDE_SHARE) == 0.4 and half.time("F") == 1.0
    assert half.time("BW_COMM") == 0.5
