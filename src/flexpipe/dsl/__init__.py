"""The FlexPipe DSL: three ways to say a schedule, one engine (``Program`` -> ``Schedule``).

* explicit order: ``Program`` + pass queues + combinators (``alternate``, ``after_each``, ...);
* policy: ``Policy`` (preferences and limits) run by a cost-model-driven list scheduler;
* building block: one micro-batch's passes with offsets, repeated every T, squeezed.

New op kinds are declared with ``op_kind``. See docs/dsl.md.
"""

from flexpipe.dsl.block import Block, greedy_block
from flexpipe.dsl.kinds import op_kind
from flexpipe.dsl.loader import entry
from flexpipe.dsl.order import Passes, after_each, alternate, interleave
from flexpipe.dsl.policy import ListScheduler, Policy, policy_schedule
from flexpipe.dsl.program import Program
from flexpipe.dsl.squeeze import squeeze
from flexpipe.ir import Gate, MemEffect, Need, Op, Placement, Schedule, StageGraph

__all__ = [
    "Block", "Gate", "ListScheduler", "MemEffect", "Need", "Op", "Passes", "Placement", "Policy",
    "Program", "Schedule", "StageGraph", "after_each", "alternate", "entry", "greedy_block",
    "interleave", "op_kind", "policy_schedule", "squeeze",
]
