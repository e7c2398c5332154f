"""Recompute added to any schedule: ``with_recompute(schedule, "SR")`` puts one SR (selective
recompute of the regions a forward dropped) or R (the whole stage again from its input) right
before each micro-batch's first backward (B or BW) on its rank (before an overlapped
pair holding it), so 1F1B, ZB-H1, ZB-V or any
other order trades that recompute for the activations it drops. ``recompute_stages(schedule,
{0: "SR", 3: "R"})`` does the same on the named stages only (the others keep their
activations), which is how the search trades recompute for memory where a rank needs it
(``flexpipe.search.recompute``). A schedule that already recomputes is returned as it is."""

from __future__ import annotations

from collections.abc import Mapping

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
    return recompute_stages(schedule, dict.fromkeys(range(schedule.num_stages), kind))


def recompute_stages(schedule: Schedule, plan: Mapping[int, str]) -> Schedule:
    """``schedule`` with ``plan[s]`` (SR or R) before each micro-batch's first backward of
    every stage s the plan names; the other stages unchanged."""
    for stage, kind in plan.items():
        if kind not in KINDS:
            raise ConfigError(f"recompute kind {kind!r} for stage {stage}: expected one of "
                              f"{', '.join(KINDS)}")
        if not 0 <= stage < schedule.num_stages:
            raise ConfigError(f"recompute on stage {stage}: the schedule has stages 0.."
                              f"{schedule.num_stages - 1}")
    if recomputes(schedule) or not plan:
        return schedule
    ranks = []
    for ops in schedule.ranks:
        done: set[tuple[int, int]] = set()
        out: list[Op] = []
        for op in ops:
            redo = plan.get(op.stage)
            if redo is not None and op.kind in BACKWARDS and (op.stage, op.mb) not in done:
                done.add((op.stage, op.mb))
                paired = bool(out) and ((out[-1], op) in schedule.overlaps
                                        or (op, out[-1]) in schedule.overlaps)
                out.insert(len(out) - paired, Op(redo, op.stage, op.mb))  # not inside a pair
            out.append(op)
        ranks.append(out)
    return schedule.with_ranks(ranks)
