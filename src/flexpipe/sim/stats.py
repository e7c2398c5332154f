"""Statistics for comparing measured times on a shared machine: whether paired measurements of
two things (step k of schedule A over step k of schedule B, run side by side) order them, by an
exact Wilcoxon signed-rank test on the ratios' logs (no SciPy needed; pure Python)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from flexpipe.errors import ConfigError


def signed_rank_p(ratios: Sequence[float]) -> float:
    """Two-sided p-value of the Wilcoxon signed-rank test that the ratios' logs are centred on
    0 (exact: the rank sum's distribution over every sign pattern, counted by dynamic
    programming; ties in magnitude take their mean rank, pairs at exactly 1 are dropped)."""
    bad = [r for r in ratios if not (r > 0 and math.isfinite(r))]
    if bad:
        raise ConfigError(f"a ratio of two measured times must be positive and finite, "
                          f"got {bad[0]!r}")
    logs = [math.log(r) for r in ratios if r != 1.0]
    if not logs:
        return 1.0
    mags = sorted(abs(x) for x in logs)
    rank = {m: (2 * mags.index(m) + mags.count(m) + 1) / 2 for m in mags}
    doubled = [round(2 * rank[abs(x)]) for x in logs]  # half ranks as integers
    below = sum(d for d, x in zip(doubled, logs, strict=True) if x < 0)
    counts = {0: 1}
    for d in doubled:  # how many sign patterns give each (doubled) negative rank sum
        nxt = dict(counts)
        for total, n in counts.items():
            nxt[total + d] = nxt.get(total + d, 0) + n
        counts = nxt
    tail = min(below, sum(doubled) - below)
    p = 2 * sum(n for total, n in counts.items() if total <= tail) / 2 ** len(logs)
    return min(p, 1.0)
