"""The data-parallel gradient reduction of a step on each rank's link to its replicas, after a
simulated (or measured) pipeline trace.

A stage's gradients are final at the end of its last op whose kind adds to them (``grads``:
B, W, BW); its reduction then takes ``reduce_time[stage]`` on its rank's data-parallel link.
Overlapped, a rank's link carries its stages' reductions one after another in the order they
become final, each starting at the later of that moment and the link's previous reduction, while
the rank computes on; the step ends when the last op and the last reduction of every rank have
ended. After the step (no overlap), every reduction starts when the pipeline's last op has
ended (as one all-reduce of every gradient after the step would).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.sim.trace import Trace


@dataclass(frozen=True)
class Reduced:
    """A step with its gradient reduction: the pipeline's end, the step's end overlapped and
    after the step, and the share of the reduction time hidden behind compute."""

    pipeline: float
    overlapped: float
    after: float

    @property
    def hidden(self) -> float:
        """The share of the after-step reduction time the overlap hides (1: all of it)."""
        exposed = self.after - self.pipeline
        return 1.0 if exposed <= 0 else (self.after - self.overlapped) / exposed


def ready_times(trace: Trace, registry: KindRegistry = KINDS) -> dict[int, float]:
    """Stage -> the time its gradients are final in ``trace`` (the end of its last op that adds
    to them); stages with no such op are left out."""
    ready: dict[int, float] = {}
    for rec in trace.records():
        if registry[rec.op.kind].grads:
            ready[rec.op.stage] = max(ready.get(rec.op.stage, rec.end), rec.end)
    return ready


def reduce_step(trace: Trace, reduce_time: Mapping[int, float],
                registry: KindRegistry = KINDS) -> Reduced:
    """The step of ``trace`` with each stage's reduction of ``reduce_time[stage]`` seconds (a
    stage left out: nothing to reduce) on its rank's data-parallel link."""
    ends = [max(rank_ends, default=0.0) for rank_ends in trace.ends]
    pipeline = max(ends, default=0.0)
    ready = ready_times(trace, registry)
    stage_rank = trace.schedule.placement.stage_rank
    free = [0.0] * len(ends)  # when each rank's link is next free
    after = [pipeline] * len(ends)
    for stage, t in sorted(ready.items(), key=lambda kv: (kv[1], kv[0])):
        r, cost = stage_rank[stage], reduce_time.get(stage, 0.0)
        free[r] = max(t, free[r]) + cost
        after[r] += cost
    done = [max(e, f) for e, f in zip(ends, free, strict=True)]
    return Reduced(pipeline, max(done, default=0.0), max(after, default=0.0))
