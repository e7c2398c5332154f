"""The schedule IR: op kinds, ops, placements, stage graphs, schedules and their text form."""

from flexpipe.ir.deps import DepIndex
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.kinds import (
    KINDS,
    Gate,
    KindRegistry,
    MemEffect,
    Need,
    OpKind,
    kind,
    register_kind,
)
from flexpipe.ir.op import BW, B, F, Op, R, W
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.text import format_schedule, parse_op, parse_schedule

__all__ = [
    "B", "BW", "DepIndex", "F", "Gate", "KINDS", "KindRegistry", "MemEffect", "Need", "Op",
    "OpKind", "Placement", "R", "Schedule", "StageGraph", "W", "format_schedule", "kind",
    "parse_op", "parse_schedule", "register_kind",
]
