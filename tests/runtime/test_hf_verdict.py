"""``benchmarks/hf_models.py``'s verdict on a pair of schedules: the predicted order against the
measured one (claimed only when the signed-rank test resolves it) and the prediction against the
measured ratio's 95% interval, on made-up rounds whose answer is known."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")
import hf_models  # noqa: E402 - needs transformers


def _rounds(pred: float, ratios: list[float]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Two schedules' rounds: a's predicted makespan ``pred`` times b's, a's steps ``ratios``
    times b's (5 steps a round)."""
    a, b = [], []
    for k in range(0, len(ratios), 5):
        steps = [1000.0] * len(ratios[k:k + 5])
        b.append({"pred_makespan": 1000.0, "replayed": 1000.0, "steps_ms": steps})
        a.append({"pred_makespan": 1000.0 * pred, "replayed": 1000.0,
                  "steps_ms": [t * r for t, r in zip(steps, ratios[k:k + 5], strict=True)]})
    return a, b


CLEAR = [1.05, 1.04, 1.06, 1.03, 1.05, 1.04, 1.02, 1.05, 1.06, 1.03]  # 95%: 1.035-1.055
MIXED = [1.04, 0.97, 1.03, 0.98, 1.05, 0.96, 1.01, 1.03, 0.98, 1.02]  # 95%: 0.98-1.03


@pytest.mark.parametrize(("pred", "ratios", "want"), [
    (1.04, CLEAR, "agrees; the prediction is inside"),
    (1.20, CLEAR, "agrees; the prediction is outside"),
    (0.96, CLEAR, "disagrees; the prediction is outside"),
    (1.02, MIXED, "not resolved (signed-rank test over the pairs); the prediction is inside"),
    (1.06, MIXED, "not resolved (signed-rank test over the pairs); the prediction is outside"),
    (1.005, CLEAR, "predicted a tie (within 1%), so no order is claimed; the prediction is "
                   "outside"),
])
def test_pair_line_verdict(pred: float, ratios: list[float], want: str) -> None:
    line = hf_models.pair_line("x", "y", *_rounds(pred, ratios))
    assert line.split("\n")[0].endswith(want + " the measured 95% interval")
    assert f"x faster in {sum(r < 1 for r in ratios)} of {len(ratios)}" in line


def test_ranking_claims_an_order_only_where_told_apart() -> None:
    times = {"a": 1000.0, "b": 1020.0, "c": 1100.0}.get
    assert hf_models.order(["c", "b", "a"], times) == "a < b < c"  # 2% and 8%: beyond a tie
    resolved = {("b", "c")}  # the measured side: only b against c resolved by the test
    assert hf_models.order(["c", "b", "a"], times,
                           apart=lambda x, y: (x, y) in resolved) == "a ~ b < c"


@pytest.mark.parametrize("placed", [(0, 1), (0, 1, 2), (0, 1, 1, 0), (0, 1, 2, 3, 3, 2, 1, 0),
                                    (0, 0)])
def test_a_factory_for_every_placement(placed: tuple[int, ...]) -> None:
    """Any rank count: the rank processes import the model cut for their placement by name."""
    mod, _, attr = hf_models.factory("llama", placed).partition(":")
    assert mod == "hf_models"
    assert callable(getattr(hf_models, attr))


@pytest.mark.parametrize("attr", ["llama_on_", "llama_on_0_x", "bert_on_0_1", "gpt2_4"])
def test_no_factory_for_a_name_it_does_not_make(attr: str) -> None:
    with pytest.raises(AttributeError, match=attr):
        getattr(hf_models, attr)


def test_stages_sharing_one_rank_are_balanced_among_themselves() -> None:
    assert hf_models.balanced_over((0, 0)) == (0, 1)
    assert hf_models.balanced_over((0, 1, 1, 0)) == (0, 1, 1, 0)
