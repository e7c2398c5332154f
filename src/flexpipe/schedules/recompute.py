"""Recompute added to any schedule: ``with_recompute(schedule, "SR")`` puts one SR (selective
recompute of the regions a forward dropped) or R (the whole stage again from its input) right
before each micro-batch's first backward (B or BW) on its rank (before an overlapped
pair holding it), so 1F1B, ZB-H1, ZB-V or any
other order trades that recompute for the activations it drops. A schedule that already
recomputes is returned as it is."""

from __future__ import annotations

from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule

KINDS = ("SR", "R")
BACKWARDS = ("B", "BW")


def recomputes(schedule: Schedule) -> bool:
    """Whether ``schedule`` has an SR or R op."""
    return any(op.kind in KINDS for ops in schedule.ranks for op in ops)


def with_recompute(schedule: Schedule, kind: str = "SR") -> Schedule:
    """``schedule`` with ``kind`` (SR or R) before each micro-batch's first backward of each
    stage (see the module docstring)."""
    if kind not in KINDS:
        raise ConfigError(f"recompute kind {kind!r}: expected one of {', '.join(KINDS)}")
    if recomputes(schedule):
        return schedule
    ranks = []
    for ops in schedule.ranks:
        done: set[tuple[int, int]] = set()
        out: list[Op] = []
        for op in ops:
            if op.kind in BACKWARDS and (op.stage, op.mb) not in done:
                done.add((op.stage, op.mb))
                paired = bool(out) and ((out[-1], op) in schedule.overlaps
                                        or (op, out[-1]) in schedule.overlaps)
                out.insert(len(out) - paired, Op(kind, op.stage, op.mb))  # not inside a pair
            out.append(op)
        ranks.append(out)
    return schedule.with_ranks(ranks)
