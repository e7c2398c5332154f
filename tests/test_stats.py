"""The signed-rank test that decides whether paired step times order two schedules: against
brute force over every sign pattern, and its invariants."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.errors import ConfigError
from flexpipe.sim.stats import signed_rank_p

RATIO = st.floats(min_value=0.5, max_value=2.0).filter(lambda r: r != 1.0)


def _brute(ratios: list[float]) -> float:
    """Two-sided p by enumerating every sign pattern of the (mean-tied) ranks."""
    logs = [math.log(r) for r in ratios if r != 1.0]
    mags = sorted(abs(x) for x in logs)
    ranks = [(2 * mags.index(abs(x)) + mags.count(abs(x)) + 1) / 2 for x in logs]
    total = sum(ranks)
    seen = sum(k for k, x in zip(ranks, logs, strict=True) if x < 0)
    tail = min(seen, total - seen)
    hits = sum(1 for signs in itertools.product((0, 1), repeat=len(logs))
               if min(w := sum(k for k, s in zip(ranks, signs, strict=True) if s),
                      total - w) <= tail + 1e-9)
    return hits / 2 ** len(logs)


@settings(max_examples=60, deadline=None)
@given(st.lists(RATIO, min_size=1, max_size=10))
def test_matches_brute_force(ratios: list[float]) -> None:
    assert signed_rank_p(ratios) == pytest.approx(_brute(ratios))


@settings(max_examples=60, deadline=None)
@given(st.lists(RATIO, min_size=1, max_size=14))
def test_is_a_probability_and_symmetric_in_which_schedule_comes_first(ratios: list[float]
                                                                        ) -> None:
    p = signed_rank_p(ratios)
    assert 0.0 < p <= 1.0
    assert signed_rank_p([1 / r for r in ratios]) == pytest.approx(p)


def test_consistent_wins_resolve_and_mixed_ones_do_not() -> None:
    assert signed_rank_p([1.03] * 6) == pytest.approx(2 / 64)  # every pair one way: 2 / 2^n
    assert signed_rank_p([1.03] * 5) > 0.05  # 5 pairs can never resolve at 5%
    assert signed_rank_p([1.05, 0.99, 1.04, 1.06, 1.03, 1.02, 1.05, 1.04, 1.01]) < 0.05
    assert signed_rank_p([1.05, 0.95, 1.04, 0.96, 1.02, 0.98]) > 0.5
    assert signed_rank_p([1.0, 1.0]) == 1.0  # no pair differs


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_a_ratio_that_is_not_positive_and_finite_is_refused_by_value(bad: float) -> None:
    with pytest.raises(ConfigError, match="positive and finite"):
        signed_rank_p([1.02, bad])
