"""Cutting the layer sequence into contiguous stages by dynamic programming.

Given the device of every stage, the cost of stage s taking layers i..j-1 is its F + B + W time
per micro-batch on that device plus the round trip of its output over the link to the next
stage's device; a stage whose parameters plus the activations it may hold (``held`` micro-batches)
exceed the device's memory costs infinity. Two passes over the same cost matrices:

1. minimax: the smallest possible bottleneck T* (the slowest stage or link);
2. for a few thresholds T >= T*, the smallest sum of stage costs with every stage under T.

Each pass's answers are partitions; the planner scores them with the pipeline formula
(m - 1) x bottleneck + sum and simulates the best. Matrices are numpy, vectorised over (i, j).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flexpipe.plan.problem import Cluster, Model

THRESHOLDS = (1.0, 1.05, 1.15, 1.3, 1.6)
Held = Callable[[int, int], float]  # (stage, stages) -> micro-batches of activation it holds


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(np.asarray(values, dtype=float))))


class Costs:
    """The (layers + 1) x (layers + 1) cost matrix of every stage: ``of(s)[i, j]`` is stage s
    taking layers i..j-1 (inf where j <= i or it does not fit)."""

    def __init__(self, model: Model, cluster: Cluster, devices: Sequence[int], b: int,
                 held: Held, mem_share: float = 1.0) -> None:
        layers = model.layers
        n = len(layers)
        work, act, par = (_prefix([getattr(x, k) for x in layers])
                          for k in ("work", "act", "params"))
        self.span = work[None, :] - work[:, None]
        self.act = b * (act[None, :] - act[:, None])
        self.par = par[None, :] - par[:, None]
        self.out = b * np.array([0.0] + [x.out_bytes for x in layers])  # out[j]: layer j-1
        self.valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
        self.model, self.cluster, self.devices, self.b = model, cluster, tuple(devices), b
        self.held, self.mem_share = held, mem_share

    def of(self, s: int) -> np.ndarray:
        """Cost matrix of stage s."""
        cl, devs = self.cluster, self.devices
        dev = cl.devices[self.devices[s]]
        cost = self.span * (self.b / dev.speed)
        if s + 1 < len(devs):
            a, c = devs[s], devs[s + 1]
            trip = np.array([cl.link(a, c, x) + cl.link(c, a, x) for x in self.out])
            cost = cost + trip[None, :]
        mem = self.par + self.held(s, len(devs)) * self.act
        ok = self.valid & (mem <= dev.memory * self.mem_share)
        return np.where(ok, cost, np.inf)


def minimax(costs: Costs) -> float:
    """The smallest bottleneck over partitions into ``len(costs.devices)`` stages."""
    n_stages, n = len(costs.devices), costs.span.shape[0] - 1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for s in range(n_stages):
        best = np.maximum(best[:, None], costs.of(s)).min(axis=0)
    return float(best[n])


def min_sum(costs: Costs, limit: float) -> tuple[int, ...] | None:
    """Cuts of the partition with the smallest sum of stage costs, each at most ``limit``."""
    n_stages, n = len(costs.devices), costs.span.shape[0] - 1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    back = []
    for s in range(n_stages):
        c = costs.of(s)
        total = best[:, None] + np.where(c <= limit * (1 + 1e-12), c, np.inf)
        back.append(total.argmin(axis=0))
        best = total.min(axis=0)
    if not np.isfinite(best[n]):
        return None
    cuts, j = [n], n
    for s in range(n_stages - 1, -1, -1):
        j = int(back[s][j])
        cuts.append(j)
    return tuple(reversed(cuts))


def partitions(costs: Costs, thresholds: Sequence[float] = THRESHOLDS) -> list[tuple[int, ...]]:
    """Distinct candidate cuts: min-sum partitions under each threshold x the minimax bottleneck
    (empty when no partition fits memory)."""
    star = minimax(costs)
    if not np.isfinite(star):
        return []
    out: list[tuple[int, ...]] = []
    for k in thresholds:
        cuts = min_sum(costs, star * k)
        if cuts is not None and cuts not in out:
            out.append(cuts)
    return out


def uniform_cuts(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Megatron's split: equal layer counts, earlier stages take the remainder."""
    base, extra = divmod(num_layers, num_stages)
    cuts = [0]
    for s in range(num_stages):
        cuts.append(cuts[-1] + base + (1 if s < extra else 0))
    return tuple(cuts)
