"""Squeeze and reorder a building block's repetition: a list scheduler that prefers each op in
block-time order but may run a later one when the next is not ready, under the block's memory
bound (or a given limit). In the steady phase this is exactly the block; in warm-up and
cool-down it fills idle slots the plain repetition would leave."""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import Block
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule


def squeeze(block: Block, m: int, cost: CostModel, mem_limit: float | None = None,
            name: str = "") -> Schedule:
    """The squeezed schedule of ``block`` for m micro-batches; memory limit per rank defaults to
    the block's bound sum ceil(l_s/T) m_s (the largest over ranks)."""
    limit = max(block.memory_bound(cost)) if mem_limit is None else mem_limit
    offsets, T = block.offsets, block.interval

    def block_time(op: Op) -> float:
        return offsets[Op(op.kind, op.stage, 0)] + op.mb * T

    split = any(op.kind == "W" for op in offsets)
    policy = Policy(priority=block_time, mem_limit=limit, split=split)
    return policy_schedule(block.placement, m, policy, cost, block.graph, name)
