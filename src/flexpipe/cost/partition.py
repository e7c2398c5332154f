"""Cutting a sequence of layers into contiguous stages: the one dynamic programme behind every
balanced partition in FlexPipe (the planner's device-aware cuts, the graph presets' balanced
stages, ``flexpipe run --partition auto``'s starting point), and the even split.

A partition into k stages is given by its cuts ``(0, c1, ..., n)``: stage s takes layers
``cuts[s]:cuts[s + 1]``. The programme takes, per stage s, an (n + 1) x (n + 1) matrix whose
entry [i, j] is the cost of stage s taking layers i..j-1 (inf where j <= i or not allowed), and
joins stage costs by ``max`` (the bottleneck) or ``+`` (the sum). Ties go to the earliest cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
