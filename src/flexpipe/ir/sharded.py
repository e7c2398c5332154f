"""Any schedule with its stages sharded over the data-parallel replicas (FSDP): each stage
gathers its parameters once per step, just before its first pass, and reduce-scatters its
gradients (freeing the gathered parameters) just after its last weight-gradient pass, as
torchtitan's FSDP2 runs a pipeline stage with resharding after the step.

The gather and the free are the DSL's own op kinds (AG, RS), so the validator checks them, the
simulator prices them on the communication stream and counts the gathered parameters in the
memory curve, and the runtime runs them on torch's FSDP2 (``flexpipe.runtime.execution.fsdp``).
A schedule that places its own AG/RS (ZeroPP's blockwise units) is kept as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule

COMPUTE = frozenset({"F", "B", "W", "BW", "R", "SR", "OFFLOAD", "RELOAD"})
"""The kinds that compute on (or move activations of) a stage: AG must come before the first."""
GRADIENTS = frozenset({"W", "BW"})
"""The kinds after whose last one a stage's gradients are complete: RS comes after it."""


def gathers(schedule: Schedule) -> bool:
    """Whether ``schedule`` already gathers parameters (has AG ops)."""
    return any(op.kind == "AG" for ops in schedule.ranks for op in ops)


def shard_per_step(schedule: Schedule) -> Schedule:
    """``schedule`` with one AG before each stage's first pass on its rank and one RS after its
    last W/BW (unchanged if it has AG ops already). A stage with no W/BW on its rank (its
    gradients computed elsewhere) is refused by the validator as an AG without an RS."""
    if gathers(schedule):
        return schedule
    firsts = {a for a, _ in schedule.overlaps}
    return schedule.with_ranks([_sharded(ops, firsts) for ops in schedule.ranks])


def _sharded(ops: Sequence[Op], paired_first: set[Op] | frozenset[Op]) -> list[Op]:
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.kind in COMPUTE:
            first.setdefault(op.stage, i)
        if op.kind in GRADIENTS:
            last[op.stage] = i + 1 if op in paired_first else i  # after a pair's partner
    mb = {s: ops[i].mb for s, i in first.items()}
    before = {i: s for s, i in first.items()}
    after: dict[int, list[int]] = {}
    for s, i in last.items():
        after.setdefault(i, []).append(s)
    out: list[Op] = []
    for i, op in enumerate(ops):
        if i in before:
            out.append(Op("AG", before[i], mb[before[i]]))
        out.append(op)
        out += [Op("RS", s, mb[s]) for s in sorted(after.get(i, ()))]
    return out
