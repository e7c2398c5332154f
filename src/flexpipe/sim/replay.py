"""Replay: a measured step re-timed by the simulator with the ops' own measured durations.

A prediction can be off for two reasons: the ops ran longer or shorter than profiled, or the
time between them (waiting on another rank, on a transfer) differs from the model. Replaying
the measured step separates the two: every compute op takes the time it took, everything else
is the simulator's (dependencies, link latency and occupancy, streams), so

    predicted -> replayed   is what the op times account for,
    replayed  -> measured   is what the waits and transfers account for.

A replay that matches the measured step says the simulator's model of the schedule holds and
only the op times were off; the ranking of schedules replayed is the ranking their measured op
times imply.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.sim.engine import simulate
from flexpipe.sim.trace import Trace


def replay(measured: Trace, cost: CostModel, registry: KindRegistry = KINDS) -> Trace:
    """``measured.schedule`` simulated under ``cost`` with every compute-stream op lasting what
    it lasted in ``measured`` (communication ops keep the model's timing: a measured receive
    ends when its data arrived, which is the wait the replay recomputes)."""
    sched = measured.schedule
    if len(measured.starts) != sched.num_ranks:
        raise ConfigError(f"the measured trace has {len(measured.starts)} ranks of times, its "
                          f"schedule {sched.num_ranks}")
    durations = []
    for r, ops in enumerate(sched.ranks):
        starts, ends = measured.starts[r], measured.ends[r]
        if not len(starts) == len(ends) == len(ops):
            raise ConfigError(f"rank {r} of the measured trace has {len(starts)} start and "
                              f"{len(ends)} end times for {len(ops)} ops")
        durations.append([e - s if registry[op.kind].stream == "compute" else None
                          for op, s, e in zip(ops, starts, ends, strict=True)])
    return simulate(sched, cost, registry, durations=durations)


@dataclass(frozen=True)
class Split:
    """A step's makespan predicted, replayed with its measured op times, and measured."""

    predicted: float
    replayed: float
    measured: float

    @property
    def op_times(self) -> float:
        """What the ops' own times account for: replayed - predicted."""
        return self.replayed - self.predicted

    @property
    def between(self) -> float:
        """What the waits and transfers account for: measured - replayed."""
        return self.measured - self.replayed


def split(predicted: Trace, measured: Trace, cost: CostModel,
          registry: KindRegistry = KINDS) -> Split:
    """Where a prediction's error comes from (see the module docstring)."""
    return Split(predicted.metrics(registry).makespan,
                 replay(measured, cost, registry).metrics(registry).makespan,
                 measured.metrics(registry).makespan)
