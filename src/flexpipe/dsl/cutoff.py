"""Stop a list-scheduler run once its schedule provably cannot beat a given objective value
(the search's incumbent), instead of building and simulating it to the end.

The list scheduler places each pass at max(its rank's free time, its inputs' arrival) -- the
same earliest start the simulator gives a fixed per-rank order with the same transfer times --
and a rank's passes are placed in start order. So once rank r is free at f_r with passes of
total time w_r still to place, its last pass ends at f_r + w_r or later; f_r + w_r only grows
(each placed pass adds its idle time before it). Hence makespan >= max_r (f_r + w_r) - t0
(t0: the earliest start placed so far; a pass placed later that starts earlier only widens the
makespan), and rank r's span >= f_r + w_r - s_r (s_r: its first pass's start, fixed once
placed). ``Cutoff.value`` is compared with a relative margin of 1e-9, far above the rounding
of the running sums. ``tests/test_search_bounds.py`` checks that the scheduler's own end times
are the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexpipe.errors import ConfigError, InfeasibleError

MARGIN = 1e-9  # relative: the bound must exceed the value by this much


class CutoffReached(InfeasibleError):
    """The run was stopped: its schedule ends no better than the cutoff."""


@dataclass(frozen=True)
class Cutoff:
    """Stop when ``measure`` ("makespan": first start to last end over all ranks, or "span":
    the largest per-rank span) is bound to exceed ``value``."""

    measure: str
    value: float

    def __post_init__(self) -> None:
        if self.measure not in ("makespan", "span"):
            raise ConfigError(f"unknown cutoff measure {self.measure!r} (makespan, span)")


@dataclass
class CutoffTracker:
    """The running bound of one run: per rank the work still to place and the first start."""

    cutoff: Cutoff
    left: list[float]
    first: list[float | None] = field(init=False)
    t0: float = field(init=False, default=float("inf"))

    def __post_init__(self) -> None:
        self.first = [None] * len(self.left)

    def placed(self, rank: int, start: float, end: float, duration: float) -> None:
        """Record a pass placed on ``rank`` from ``start`` to ``end``; CutoffReached once the
        schedule cannot end within the cutoff."""
        self.left[rank] -= duration
        first = self.first[rank]
        if first is None:
            first = self.first[rank] = start
        self.t0 = min(self.t0, start)
        origin = self.t0 if self.cutoff.measure == "makespan" else first
        bound = end + self.left[rank] - origin
        if bound > self.cutoff.value * (1 + MARGIN) + MARGIN:
            raise CutoffReached(f"its {self.cutoff.measure} is at least {bound:g} > "
                                f"{self.cutoff.value:g}")
