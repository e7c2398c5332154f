"""The one cutting programme (``flexpipe.cost.partition``) against brute force: the smallest
bottleneck, the smallest sum under a limit, and the even split."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.partition import (
    TOTAL,
    best_cuts,
    minimax_cuts,
    sizes,
    span_matrix,
    uniform_cuts,
)

WEIGHTS = st.lists(st.integers(1, 9).map(float), min_size=1, max_size=9)


def every_cut(n: int, k: int) -> list[tuple[int, ...]]:
    return [(0, *inner, n) for inner in combinations(range(1, n), k - 1)]


def stage_sums(weights: list[float], cuts: tuple[int, ...]) -> list[float]:
    return [sum(weights[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]


@settings(max_examples=60, deadline=None)
@given(WEIGHTS, st.integers(1, 9))
def test_minimax_cuts_match_brute_force(weights: list[float], k: int) -> None:
    k = min(k, len(weights))
    want = min(max(stage_sums(weights, c)) for c in every_cut(len(weights), k))
    cuts = minimax_cuts(weights, k)
    assert len(cuts) == k + 1 and all(x > 0 for x in sizes(cuts))
    assert max(stage_sums(weights, cuts)) == want


@settings(max_examples=60, deadline=None)
@given(WEIGHTS, st.integers(1, 9), st.floats(1.0, 40.0))
def test_smallest_sum_under_a_limit_matches_brute_force(weights: list[float], k: int,
                                                       limit: float) -> None:
    """Per-stage costs that differ by stage (stage s pays s + 1 per layer) make sums differ."""
    k = min(k, len(weights))
    spans = [span_matrix([(s + 1) * w for w in weights]) for s in range(k)]

    def total(c: tuple[int, ...]) -> list[float]:
        return [float(spans[s][c[s], c[s + 1]]) for s in range(k)]

    ok = [c for c in every_cut(len(weights), k) if max(total(c)) <= limit]
    got, cuts = best_cuts(lambda s: spans[s], k, len(weights), TOTAL, limit)
    if not ok:
        assert cuts is None
        return
    assert cuts is not None and max(total(cuts)) <= limit
    assert got == sum(total(cuts)) == min(sum(total(c)) for c in ok)


def test_uniform_cuts_give_the_remainder_to_the_first_stages() -> None:
    assert uniform_cuts(10, 4) == (0, 3, 6, 8, 10)
    assert sizes(uniform_cuts(10, 4)) == [3, 3, 2, 2]
