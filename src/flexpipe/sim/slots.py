"""The slots of overlapped pairs (``flexpipe.ir.overlap``) for the simulator: where each
rank's pairs start, and the one duration both ops of a pair take."""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.ir.overlap import BACKWARDS, HIDE_SHARE, comm_part, heads, pair_time
from flexpipe.ir.schedule import Schedule


def pair_slots(schedule: Schedule, cost: CostModel,
           durations: list[list[float]]) -> list[frozenset[int]]:
    """The positions that start a pair, per rank; in place, both ops of a pair take the slot's
    time (``flexpipe.ir.overlap.pair_time``) from their own durations and the communication
    parts their stages' costs give."""
    pairs = heads(schedule.overlaps)
    out = []
    for r, ops in enumerate(schedule.ranks):
        starts = frozenset(i for i, op in enumerate(ops) if op in pairs)
        row = durations[r]
        for i in starts:
            a, b = ops[i], ops[i + 1]
            parts = [(row[k], comm_part(op, row[k], cost.stage(op.stage).time,
                                        cost.stage(op.stage).has_time))
                     for k, op in ((i, a), (i + 1, b))]
            back = cost.stage((a if a.kind in BACKWARDS else b).stage)
            hide = back.time(HIDE_SHARE) if back.has_time(HIDE_SHARE) else 1.0
            row[i] = row[i + 1] = pair_time(parts[0], parts[1], hide)
        out.append(starts)
    return out
