"""Wave (zig-zag) schedules in the policy DSL (Hanayo, Liu et al., SC 2023)."""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule


def hanayo(p: int, m: int, w: int = 1, cost: CostModel | None = None) -> Schedule:
    """Hanayo wave schedule: 2w chunks per rank on a zig-zag placement (down the ranks, back up,
    w times), fused backward first, then forward, activation memory capped at 1F1B's p M_B.
    Bubble about (p-1)/(2w m) of the step at unit costs, shrinking as waves are added."""
    if not isinstance(w, int) or w < 1:
        raise ConfigError(f"hanayo needs w >= 1 waves, got {w!r}")
    placement = Placement.zigzag(p, 2 * w)
    policy = Policy(prefer=("B", "F"), split=False, mem_limit=float(p))
    return policy_schedule(placement, m, policy, cost, name="hanayo")
