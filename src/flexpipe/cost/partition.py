"""Cutting a sequence of layers into contiguous stages: the one dynamic programme behind every
balanced partition in FlexPipe (the planner's device-aware cuts, the graph presets' balanced
stages, ``flexpipe run --partition auto``), the even split, and the rank-aware balance of a
placement (``balanced_partition``: what must be even is each RANK's work, not each stage's).

A partition into k stages is given by its cuts ``(0, c1, ..., n)``: stage s takes layers
``cuts[s]:cuts[s + 1]``. The programme takes, per stage s, an (n + 1) x (n + 1) matrix whose
entry [i, j] is the cost of stage s taking layers i..j-1 (inf where j <= i or not allowed), and
joins stage costs by ``max`` (the bottleneck) or ``+`` (the sum). Ties go to the earliest cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import combinations
from math import comb

import numpy as np

from flexpipe.errors import ConfigError

StageMatrix = Callable[[int], np.ndarray]  # stage -> (n + 1) x (n + 1) cost matrix
Join = Callable[[np.ndarray, np.ndarray], np.ndarray]
BOTTLENECK: Join = np.maximum
TOTAL: Join = np.add


def span_matrix(weights: Sequence[float]) -> np.ndarray:
    """[i, j] = weights[i] + ... + weights[j - 1] (prefix differences), inf where j <= i."""
    pre = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=float))))
    span = pre[None, :] - pre[:, None]
    return np.where(np.triu(np.ones(span.shape, dtype=bool), 1), span, np.inf)


def best_cuts(of: StageMatrix, stages: int, n: int, join: Join = BOTTLENECK,
              limit: float = np.inf) -> tuple[float, tuple[int, ...] | None]:
    """The smallest joined cost of cutting n layers into ``stages`` stages, every stage costing
    at most ``limit``, and its cuts (None when no partition is finite)."""
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back = []
    for s in range(stages):
        c = of(s)
        if np.isfinite(limit):
            c = np.where(c <= limit * (1 + 1e-12), c, np.inf)
        total = join(best[:, None], c)
        back.append(total.argmin(axis=0))
        best = total.min(axis=0)
    if not np.isfinite(best[n]):
        return float(best[n]), None
    cuts, j = [n], n
    for s in range(stages - 1, -1, -1):
        j = int(back[s][j])
        cuts.append(j)
    return float(best[n]), tuple(reversed(cuts))


def minimax_cuts(weights: Sequence[float], stages: int) -> tuple[int, ...]:
    """Cuts of ``weights`` into ``stages`` non-empty stages with the smallest heaviest stage."""
    span = span_matrix(weights)
    _, cuts = best_cuts(lambda s: span, stages, len(weights))
    if cuts is None:
        raise ConfigError(f"cannot cut {len(weights)} layers into {stages} non-empty stages")
    return cuts


def uniform_cuts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Megatron's split: equal layer counts, earlier stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    cuts = [0]
    for s in range(num_stages):
        cuts.append(cuts[-1] + base + (1 if s < extra else 0))
    return tuple(cuts)


def sizes(cuts: Sequence[int]) -> list[int]:
    """Layers per stage of ``cuts``."""
    return [b - a for a, b in zip(cuts, cuts[1:], strict=False)]


def boundary_moves(cuts: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every cuts with one inner boundary moved by one layer (stages stay non-empty)."""
    for i in range(1, len(cuts) - 1):
        for step in (-1, 1):
            moved = cuts[i] + step
            if cuts[i - 1] < moved < cuts[i + 1]:
                yield (*cuts[:i], moved, *cuts[i + 1:])


EXACT_LIMIT = 20000
"""``balanced_partition`` enumerates every partition up to this many, else searches locally."""
Key = tuple[float, float, float]


def balanced_partition(costs: Sequence[float], stage_rank: Sequence[int]) -> list[int]:
    """Layers per stage (every stage at least one) that balance the ranks' work; ``costs[i]``
    is layer i's work, ``stage_rank[s]`` the rank of stage s. The busiest rank's work is
    minimised, then the busiest stage's, then the spread (sum of squared rank loads): exactly
    by enumeration up to ``EXACT_LIMIT`` partitions, else the better of two local searches
    (one-boundary moves) from the stage-minimax cuts and from even layer counts."""
    n, stages = len(costs), len(stage_rank)
    if n < stages:
        raise ConfigError(f"the model has {n} layers, fewer than the {stages} stages of the "
                          f"schedule; use a deeper model or fewer stages")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(costs, dtype=float)))).tolist()

    def key(cuts: tuple[int, ...]) -> Key:
        loads = [0.0] * (max(stage_rank) + 1)
        worst_stage = 0.0
        for s, r in enumerate(stage_rank):
            w = prefix[cuts[s + 1]] - prefix[cuts[s]]
            loads[r] += w
            worst_stage = max(worst_stage, w)
        return max(loads), worst_stage, sum(x * x for x in loads)

    if comb(n - 1, stages - 1) <= EXACT_LIMIT:
        every = ((0, *inner, n) for inner in combinations(range(1, n), stages - 1))
        best: tuple[int, ...] = min(every, key=key)
    else:
        starts = (_stage_minimax(costs, stages), uniform_cuts(n, stages))
        best = min((_improve(c, key) for c in starts), key=key)
    return sizes(best)


def _stage_minimax(costs: Sequence[float], stages: int) -> tuple[int, ...]:
    """Cuts under the smallest possible heaviest stage: the bottleneck, then the earliest
    cuts that stay under it."""
    span = span_matrix(costs)
    star, _ = best_cuts(lambda s: span, stages, len(costs))
    _, cuts = best_cuts(lambda s: span, stages, len(costs), TOTAL, star)
    assert cuts is not None, "the bottleneck's own partition stays under it"
    return cuts


def _improve(cuts: tuple[int, ...], key: Callable[[tuple[int, ...]], Key]) -> tuple[int, ...]:
    """Move one inner boundary by one layer while that lowers ``key`` (first improvement)."""
    score, improved = key(cuts), True
    while improved:
        improved = False
        for cand in boundary_moves(cuts):
            got = key(cand)
            if got < score:
                cuts, score, improved = cand, got, True
                break
    return cuts
