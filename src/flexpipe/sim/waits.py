"""Name the cycle of waits of a deadlocked schedule: rank a is stuck at op x, which needs op y
that rank b has not reached because b is stuck at op z, which needs ... back to rank a."""

from __future__ import annotations

from flexpipe.errors import DeadlockError, Violation
from flexpipe.ir.around import around
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule


def deadlock_error(schedule: Schedule, index: DepIndex, ptr: list[int]) -> DeadlockError:
    """Build the error for ranks stuck at positions ``ptr`` (each waiting on an op not yet run)."""
    where: dict[Op, tuple[int, int]] = {op: (r, i) for r, i, op in schedule.ops()}
    waits: dict[int, tuple[Op, Op, int]] = {}
    for r, ops in enumerate(schedule.ranks):
        if ptr[r] >= len(ops):
            continue
        head = ops[ptr[r]]
        for d in index.needs(head):
            loc = where.get(d)
            if loc is not None and loc[1] >= ptr[loc[0]]:
                waits[r] = (head, d, loc[0])
                break
    cycle = _find_cycle({r: q for r, (_h, _d, q) in waits.items()})
    steps = [f"rank {r} waits at {waits[r][0]} for {waits[r][1]} on rank {waits[r][2]}"
             for r in cycle]
    reason = "deadlock: " + "; ".join(steps) if steps else "deadlock: ranks cannot progress"
    first = cycle[0] if cycle else next(iter(waits), 0)
    pos = ptr[first] if first < len(ptr) else 0
    op = str(schedule.ranks[first][pos]) if pos < len(schedule.ranks[first]) else None
    return DeadlockError([Violation("deadlock", reason, first, pos, op,
                                    around(schedule, first, pos))])


def _find_cycle(edges: dict[int, int]) -> list[int]:
    """A cycle in a functional graph (each node has at most one successor), or []."""
    for start in edges:
        seen: list[int] = []
        node: int | None = start
        while node is not None and node not in seen:
            seen.append(node)
            node = edges.get(node)
        if node is not None:
            return seen[seen.index(node):]
    return []
