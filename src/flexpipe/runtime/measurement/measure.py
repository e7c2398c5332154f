"""Measured traces: the op start/end times the ranks recorded, as the simulator's ``Trace`` type
(``source="measured"``), so predicted and measured runs compare with the same metrics."""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe.ir.lower import lower
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.processes.train import RankResult
from flexpipe.sim.trace import Trace


def measured_trace(schedule: Schedule, ranks: Sequence[RankResult], unit: float = 1e3) -> Trace:
    """The last step of replica 0 (tensor-parallel rank 0) as a ``Trace`` of the lowered
    schedule, times in ``unit`` per second (default ms). Memory: the live activation bytes
    after every op where the run measured them (``TrainConfig.measure_memory``: on its first
    step, placed at the last step's op ends), else flat zero curves."""
    lowered = lower(schedule)
    mine = sorted((r for r in ranks if r.replica == 0 and r.tp_rank == 0),
                  key=lambda r: r.pipe_rank)
    if len(mine) != lowered.num_ranks:
        raise ValueError(f"expected {lowered.num_ranks} pipeline ranks, got {len(mine)}")
    starts = tuple(tuple(t * unit for t in r.starts) for r in mine)
    ends = tuple(tuple(t * unit for t in r.ends) for r in mine)
    curves = tuple(_curve(e, r.activations) for e, r in zip(ends, mine, strict=True))
    static = tuple(0.0 for _ in mine)
    return Trace(schedule=lowered, starts=starts, ends=ends, memory_data=(curves, static),
                 source="measured")


def _curve(ends: Sequence[float], live: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """Live bytes after each op as (time, bytes) steps (flat zero when not measured)."""
    if len(live) != len(ends):
        return ((0.0, 0.0),)
    return ((0.0, 0.0), *sorted(zip(ends, live, strict=True)))


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    xs = sorted(values)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
