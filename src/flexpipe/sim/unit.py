"""Cost models the simulator and the validator make for themselves, in memory proportional to the
stages (not to ranks squared): the unit costs of ``default_cost`` and the zero-time model of the
deadlock check. ``Comm``'s matrices are p x p tuples, which at 4000 ranks alone is 32 million
entries checked one by one; ``UniformComm`` is the same link between every pair, stored once."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.ir.schedule import Schedule


class _Square(Sequence[tuple[float, ...]]):
    """An n x n matrix with one value everywhere, rows made on demand."""

    def __init__(self, n: int, value: float) -> None:
        self.n, self.value = n, value

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> tuple[float, ...]: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[float, ...]]: ...

    def __getitem__(self, i: int | slice) -> tuple[float, ...] | Sequence[tuple[float, ...]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return (self.value,) * self.n

    def __iter__(self) -> Iterator[tuple[float, ...]]:
        return (self[i] for i in range(self.n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, _Square):
            return (self.n, self.value) == (other.n, other.value)
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))


class UniformComm(Comm):
    """``Comm.uniform(n, latency)`` (infinite bandwidth) in constant memory."""

    def __init__(self, num_ranks: int, latency: float = 0.0) -> None:
        object.__setattr__(self, "latency", _Square(num_ranks, float(latency)))
        object.__setattr__(self, "bandwidth", _Square(num_ranks, math.inf))
        object.__setattr__(self, "_table", {})

    def link(self, src: int, dst: int, nbytes: float) -> tuple[float, float]:
        """(latency, occupancy): the latency between different ranks, no occupancy."""
        n = self.latency.n  # type: ignore[attr-defined]
        if not (0 <= src < n and 0 <= dst < n):
            return super().link(src, dst, nbytes)  # the usual error for a missing link
        return (0.0, 0.0) if src == dst else (self.latency.value, 0.0)  # type: ignore[attr-defined]


def unit_cost(schedule: Schedule) -> CostModel:
    """Each rank's F, B, W take 1 and hold 1 unit of memory, split evenly over its stages (the
    convention of ``CostModel.per_rank``), with free links."""
    stage_rank = schedule.placement.stage_rank
    counts = [0] * schedule.num_ranks
    for r in stage_rank:
        counts[r] += 1
    shared = {k: StageCost({"F": 1 / k, "B": 1 / k, "W": 1 / k}, act=1 / k, wact=1 / k,
                           input=1 / (8 * k)) for k in set(counts) if k}
    return CostModel(tuple(shared[counts[r]] for r in stage_rank),
                     UniformComm(schedule.num_ranks))


def zero_cost(schedule: Schedule, keys: Sequence[str]) -> CostModel:
    """Every op takes no time (each key in ``keys`` and F, B, W is 0) and links are free:
    enough to find a cycle of waits."""
    stage = StageCost(dict.fromkeys(("F", "B", "W", *keys), 0.0))
    return CostModel((stage,) * schedule.num_stages, UniformComm(schedule.num_ranks))
