"""Wave (zig-zag) schedules in the policy DSL (Hanayo, Liu et al., SC 2023)."""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.units import one_f_one_b_memory


def hanayo(p: int, m: int, w: int = 1, cost: CostModel | None = None) -> Schedule:
    """Hanayo wave schedule: 2w chunks per rank on a zig-zag placement (down the ranks, back up,
    w times), with fused backwards; a rank prefers a ready forward (keeping the wave moving)
    and caps activation memory at 1F1B's p M_B. At unit costs about 0.7x 1F1B's bubble at the
    same memory for w = 1 (p=8, m=24: 0.163 vs 0.226)."""
    if not isinstance(w, int) or w < 1:
        raise ConfigError(f"hanayo needs w >= 1 waves, got {w!r}")
    placement = Placement.zigzag(p, 2 * w)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    policy = Policy(prefer=("F", "B"), split=False, reserve="auto",
                    mem_limit=one_f_one_b_memory(placement, cost))
    return policy_schedule(placement, m, policy, cost, name="hanayo")
