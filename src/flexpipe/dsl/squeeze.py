"""Squeeze and reorder a building block's repetition: a list scheduler that prefers each op in
block-time order but may run a later one when the next is not ready, under the block's memory
bound (or a given limit). In the steady phase this is exactly the block; in warm-up and
cool-down it fills idle slots the plain repetition would leave. Optionally the cool-down's weight
gradients (W passes placed, in block time, after the rank's last forward) only fill idle time, so
the input gradients the earlier ranks wait for go first (as in ZB-V's fixed order)."""

from __future__ import annotations

import math

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import Block
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule


def squeeze(block: Block, m: int, cost: CostModel, mem_limit: float | None = None,
            name: str = "", *, tail_w_fills: bool = False, reserve: str = "all") -> Schedule:
    """The squeezed schedule of ``block`` for m micro-batches; memory limit per rank defaults to
    the block's bound sum ceil(l_s/T) m_s (the largest over ranks). ``tail_w_fills``: a W whose
    block time is after its rank's last forward runs only when nothing else is ready.
    ``reserve``: the list scheduler's memory reservation mode (``Policy.reserve``)."""
    limit = max(block.memory_bound(cost)) if mem_limit is None else mem_limit
    offsets, T, pl = block.offsets, block.interval, block.placement
    last_f = [max((offsets[Op("F", s, 0)] for s in pl.rank_stages[r]), default=0.0)
              + (m - 1) * T for r in range(pl.num_ranks)]

    def block_time(op: Op) -> float:
        t = offsets[Op(op.kind, op.stage, 0)] + op.mb * T
        in_tail = op.kind == "W" and t > last_f[pl.stage_rank[op.stage]]
        return math.inf if tail_w_fills and in_tail else t

    split = any(op.kind == "W" for op in offsets)
    policy = Policy(priority=block_time, mem_limit=limit, split=split, reserve=reserve)
    return policy_schedule(block.placement, m, policy, cost, block.graph, name)
