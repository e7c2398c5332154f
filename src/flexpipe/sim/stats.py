"""Statistics for comparing measured times on a shared machine: whether paired measurements of
two things (step k of schedule A over step k of schedule B, run side by side) order them, by an
exact Wilcoxon signed-rank test on the ratios' logs, and how large the difference can be, by the
confidence interval that goes with that test (Hodges-Lehmann: the Walsh averages of the logs
between the test's critical ranks). No SciPy needed; pure Python."""

from __future__ import annotations

import math
from collections.abc import Sequence

from flexpipe.errors import ConfigError


def _logs(ratios: Sequence[float]) -> list[float]:
    """The ratios' logs; a non-positive or non-finite ratio is refused by value."""
    bad = [r for r in ratios if not (r > 0 and math.isfinite(r))]
    if bad:
        raise ConfigError(f"a ratio of two measured times must be positive and finite, "
                          f"got {bad[0]!r}")
    return [math.log(r) for r in ratios]


def _sum_counts(ranks: Sequence[int]) -> dict[int, int]:
    """How many of the 2^n sign patterns give each sum of the negatively signed ``ranks``."""
    counts = {0: 1}
    for d in ranks:
        nxt = dict(counts)
        for total, n in counts.items():
            nxt[total + d] = nxt.get(total + d, 0) + n
        counts = nxt
    return counts


def signed_rank_p(ratios: Sequence[float]) -> float:
    """Two-sided p-value of the Wilcoxon signed-rank test that the ratios' logs are centred on
    0 (exact: the rank sum's distribution over every sign pattern, counted by dynamic
    programming; ties in magnitude take their mean rank, pairs at exactly 1 are dropped)."""
    logs = [x for x in _logs(ratios) if x != 0.0]
    if not logs:
        return 1.0
    mags = sorted(abs(x) for x in logs)
    rank = {m: (2 * mags.index(m) + mags.count(m) + 1) / 2 for m in mags}
    doubled = [round(2 * rank[abs(x)]) for x in logs]  # half ranks as integers
    below = sum(d for d, x in zip(doubled, logs, strict=True) if x < 0)
    counts = _sum_counts(doubled)
    tail = min(below, sum(doubled) - below)
    p = 2 * sum(n for total, n in counts.items() if total <= tail) / 2 ** len(logs)
    return min(p, 1.0)


def ratio_interval(ratios: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The ``level`` confidence interval of the ratios' centre (the ratio one thing's time is of
    the other's), distribution-free: ``exp`` of the Walsh averages ((x_i + x_j) / 2, i <= j) of
    the logs between the signed-rank test's critical values, so the interval excludes 1 when,
    and as far as, the test at ``1 - level`` resolves the order. Too few ratios for any
    interval at that level (5 or fewer at 95%) give (0, inf)."""
    if not 0 < level < 1:
        raise ConfigError(f"a confidence level is between 0 and 1, got {level!r}")
    logs = _logs(ratios)
    n = len(logs)
    counts, total = _sum_counts(range(1, n + 1)), 2 ** n
    tail, k = 0, -1  # k: the largest rank sum with P(T <= k) <= (1 - level) / 2
    for t in range(n * (n + 1) // 2 + 1):
        tail += counts.get(t, 0)
        if tail / total > (1 - level) / 2:
            break
        k = t
    if k < 0:
        return 0.0, math.inf
    walsh = sorted((a + b) / 2 for i, a in enumerate(logs) for b in logs[i:])
    return math.exp(walsh[k]), math.exp(walsh[len(walsh) - 1 - k])
