"""A cost model from measured steps (``runtime.measurement.passes``), on hand-made step
results: each stage's median pass times and all-to-all parts, and a stage that ran its
backwards fused only (1F1B's BW) given B and W so that it makes a stage cost."""

from __future__ import annotations

import pytest

from flexpipe.cost.model import StageCost
from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.runtime.execution.executor import StepResult
from flexpipe.runtime.measurement.passes import filled, merged, post, rank_passes

OPS = (Op("F", 0, 0), Op("F", 0, 1), Op("BW", 0, 0), Op("BW", 0, 1))


def _step(spans: list[float], comm: list[float]) -> StepResult:
    starts, t = [], 0.0
    for span in spans:
        starts.append(t)
        t += span
    return StepResult(None, starts, [s + d for s, d in zip(starts, spans, strict=True)],
                      comm=comm)


def test_fused_backwards_give_b_its_bw_and_w_nothing() -> None:
    steps = [_step([1.0, 3.0, 4.0, 6.0], [0.5, 0.5, 1.0, 2.0]),
             _step([2.0, 2.0, 5.0, 5.0], [0.5, 0.5, 1.0, 1.0])]
    row = rank_passes(OPS, steps)[0]
    # the means (a step lasts the sum of its passes), not the medians (BW_COMM's would be 1)
    assert row == pytest.approx({"F": 2.0, "F_COMM": 0.5, "BW": 5.0, "BW_COMM": 1.25})
    with pytest.raises(ConfigError, match="needs time 'B'"):
        StageCost(row)
    stage = StageCost(filled(row))
    assert (stage.time("B"), stage.time("W"), stage.time("BW")) == (5.0, 0.0, 5.0)
    assert stage.time("B_COMM") == 1.25


def test_a_split_stage_is_left_as_measured_and_ranks_average() -> None:
    row = {"F": 1.0, "B": 1.0, "W": 0.5, "BW": 1.4, "B_COMM": 0.2}
    assert filled(row) == row
    table = merged([{0: {"F": 1.0}}, {0: {"F": 3.0}, 1: {"F": 2.0}}])
    assert table == {0: {"F": 2.0}, 1: {"F": 2.0}}


def test_post_is_the_median_send() -> None:
    ops = (Op("F", 0, 0), Op("SEND_F", 0, 0), Op("F", 0, 1), Op("SEND_F", 0, 1),
           Op("BW", 0, 0), Op("SEND_B", 0, 0))
    step = _step([1.0, 0.1, 1.0, 0.3, 2.0, 0.2], [0.0] * 6)
    assert post(ops, [step]) == pytest.approx(0.2)
    assert post(OPS, [_step([1.0] * 4, [0.0] * 4)]) == 0.0
