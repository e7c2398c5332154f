"""Cutting the layer sequence into contiguous stages by dynamic programming.

Given the device of every stage, the cost of stage s taking layers i..j-1 is its F + B + W time
per micro-batch on that device plus the round trip of its output over the link to the next
stage's device; a stage whose parameters plus the activations it may hold (``held`` micro-batches)
exceed the device's memory costs infinity. Two passes over the same cost matrices:

1. minimax: the smallest possible bottleneck T* (the slowest stage or link);
2. for a few thresholds T >= T*, the smallest sum of stage costs with every stage under T.

Each pass's answers are partitions; the planner scores them with the pipeline formula
(m - 1) x bottleneck + sum and simulates the best. Matrices are numpy, vectorised over (i, j);
both passes are the one cutting programme of ``flexpipe.cost.partition``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flexpipe.cost.partition import TOTAL, best_cuts
from flexpipe.cost.partition import uniform_cuts as uniform_cuts  # the planner's even split
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
            trip = np.array([cl.round_trip(a, c, x) for x in self.out])
            cost = cost + trip[None, :]
        mem = self.par + self.held(s, len(devs)) * self.act
        ok = self.valid & (mem <= dev.memory * self.mem_share)
        return np.where(ok, cost, np.inf)


def minimax(costs: Costs) -> float:
    """The smallest bottleneck over partitions into ``len(costs.devices)`` stages."""
    return best_cuts(costs.of, len(costs.devices), costs.span.shape[0] - 1)[0]


def min_sum(costs: Costs, limit: float) -> tuple[int, ...] | None:
    """Cuts of the partition with the smallest sum of stage costs, each at most ``limit``."""
    return best_cuts(costs.of, len(costs.devices), costs.span.shape[0] - 1, TOTAL, limit)[1]


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
