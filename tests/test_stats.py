"""The signed-rank test that decides whether paired step times order two schedules, and the
confidence interval of their time ratio that goes with it: against brute force over every sign
pattern, the test-interval duality, and their invariants."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.errors import ConfigError
from flexpipe.sim.stats import ratio_interval, signed_rank_p

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


def _walsh(ratios: list[float]) -> list[float]:
    logs = [math.log(r) for r in ratios]
    return sorted((a + b) / 2 for i, a in enumerate(logs) for b in logs[i:])


def _apart(ratios: list[float]) -> bool:
    """Walsh averages clear of each other, so that no shift between two of them ties two
    magnitudes (the test's mean ranks) or lands on a ratio."""
    walsh = _walsh(ratios)
    return all(b - a > 1e-6 for a, b in itertools.pairwise(walsh))


DISTINCT = st.lists(st.floats(min_value=0.8, max_value=1.25), min_size=6, max_size=12,
                    unique=True).filter(_apart)


@settings(max_examples=40, deadline=None)
@given(DISTINCT)
def test_interval_holds_the_ratios_the_test_does_not_tell_apart(ratios: list[float]) -> None:
    """Duality: shifted just inside either end, the test at 5% keeps the centre; just outside,
    it rejects it (the interval is every centre the test cannot refuse)."""
    lo, hi = ratio_interval(ratios)
    walsh = _walsh(ratios)
    k = min(range(len(walsh)), key=lambda i: abs(walsh[i] - math.log(lo)))
    assert math.log(hi) == pytest.approx(walsh[len(walsh) - 1 - k])
    inside = (walsh[k] + walsh[k + 1]) / 2
    assert signed_rank_p([r / math.exp(inside) for r in ratios]) > 0.05
    if k > 0:
        outside = (walsh[k - 1] + walsh[k]) / 2
        assert signed_rank_p([r / math.exp(outside) for r in ratios]) <= 0.05
    else:  # the lowest Walsh average: every centre below it makes all ratios one way
        assert signed_rank_p([r / (lo * 0.999) for r in ratios]) <= 0.05


@settings(max_examples=40, deadline=None)
@given(st.lists(RATIO, min_size=6, max_size=20))
def test_interval_is_ordered_and_symmetric_in_which_schedule_comes_first(ratios: list[float]
                                                                         ) -> None:
    lo, hi = ratio_interval(ratios)
    assert min(ratios) <= lo <= hi <= max(ratios)
    rlo, rhi = ratio_interval([1 / r for r in ratios])
    assert (rlo, rhi) == pytest.approx((1 / hi, 1 / lo))


def test_interval_excludes_one_when_the_order_is_resolved() -> None:
    clear = [1.05, 0.99, 1.04, 1.06, 1.03, 1.02, 1.05, 1.04, 1.01]
    assert signed_rank_p(clear) < 0.05 and ratio_interval(clear)[0] > 1.0
    mixed = [1.05, 0.95, 1.04, 0.96, 1.02, 0.98, 1.01, 0.99]
    lo, hi = ratio_interval(mixed)
    assert lo < 1.0 < hi
    assert ratio_interval([1.03] * 5) == (0.0, math.inf)  # 5 pairs: no 95% interval
    assert ratio_interval([1.02] * 12) == pytest.approx((1.02, 1.02))


def test_interval_refuses_a_bad_level_and_a_bad_ratio() -> None:
    with pytest.raises(ConfigError, match="between 0 and 1"):
        ratio_interval([1.01] * 8, level=1.0)
    with pytest.raises(ConfigError, match="positive and finite"):
        ratio_interval([1.01] * 7 + [math.nan])
