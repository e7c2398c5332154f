"""The controllable-memory V-shape family (Qi et al., NeurIPS 2024) in the building-block DSL.

Placement: V (rank i holds stages i and 2p-1-i). One micro-batch's passes are laid out as a
building block with interval T = the rank's work per micro-batch; lifespans set the memory
(peak <= sum ceil(l_s/T) m_s). Delaying each W after its B stretches lifespans: more memory,
and, once the repetition is squeezed, fewer bubbles.
"""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import Block, greedy_block
from flexpipe.dsl.squeeze import squeeze
from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule


def v_block(p: int, cost: CostModel | None = None, *, w_delay: float = 0.0,
            b_gap: float = 0.0) -> tuple[Block, CostModel]:
    """The V-shape building block; gaps are in units of one chunk's W (B) time on stage 0."""
    if not isinstance(p, int) or p < 1:
        raise ConfigError(f"p must be a positive integer, got {p!r}")
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    st = cost.stage(0)
    block = greedy_block(placement, cost, _rank_work(p, cost), w_delay=w_delay * st.time("W"),
                         b_gap=b_gap * st.time("B"))
    return block, cost


def v_min(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """V-Min: the tightest block -- every F and B within one short pass of the moment its input
    is ready, W right behind -- repeated as is. About 1/3 of 1F1B's activation memory
    ((p+4)//3 M_B at unit costs) and about 2/3 of its bubble. When T_F, T_B, T_W differ the
    tight layout only fits a longer interval T, so a bubble repeats every micro-batch."""
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    work = _rank_work(p, cost)
    shortest = min(cost.stage(s).time(k) for s in range(2 * p) for k in ("F", "B", "W"))
    for k in range(81):
        try:
            block = greedy_block(placement, cost, work * (1 + k / 40), w_delay=shortest,
                                 max_shift=shortest)
            return block.schedule(m, name="v-min")
        except ConfigError:
            continue
    return greedy_block(placement, cost, work, w_delay=shortest).schedule(m, name="v-min")


def _rank_work(p: int, cost: CostModel) -> float:
    """The largest per-micro-batch work of a rank (its two stages' F, B and W)."""
    return max(sum(cost.stage(s).time(k) for s in (i, 2 * p - 1 - i) for k in ("F", "B", "W"))
               for i in range(p))


def v_half(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """V-Half: each W held several passes after its B, the repetition squeezed under half of
    1F1B's activation memory ((p+2)//2 M_B). About half of 1F1B's bubble; no steady-phase bubble
    when T_W + 2T_B >= 2T_F and T_W + 2T_F >= 2T_B. The W delay is the better of two (3 or 12
    W passes) for this p, m and cost, by simulation."""
    from flexpipe.sim.engine import simulate

    best: tuple[float, Schedule] | None = None
    for delay in (3.0, 12.0):
        block, cost = v_block(p, cost, w_delay=delay)
        limit = ((p + 2) // 2) * _rank_act(p, cost)
        sched = squeeze(block, m, cost, mem_limit=limit, name="v-half")
        bubble = simulate(sched, cost).metrics().bubble_rate
        if best is None or bubble < best[0] - 1e-12:
            best = (bubble, sched)
    assert best is not None
    return best[1]


def v_zb(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """V-ZB: W held about 12 passes after its B (lifespans of about 2T), the repetition
    squeezed under 1F1B's activation memory (p M_B): near-zero bubble at 1F1B's memory."""
    for b_gap in (1.0, 0.0, 2.0):
        try:
            block, cost = v_block(p, cost, w_delay=12.0, b_gap=b_gap)
        except ConfigError:
            continue
        return squeeze(block, m, cost, mem_limit=p * _rank_act(p, cost), name="v-zb")
    raise ConfigError(f"v-zb: no building block fits for p={p}")


def _rank_act(p: int, cost: CostModel) -> float:
    """Activation of one micro-batch on rank 0 (both of its stages): the unit of M_B."""
    return sum(cost.stage(s).act for s in (0, 2 * p - 1))
