"""Zero-bubble schedules (Qi et al., ICLR 2024): the backward split into B (input gradient) and
W (weight gradient), with W moved to fill bubbles."""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.dsl.order import after_each, alternate
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.dsl.program import Program
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.units import one_f_one_b_memory


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1: 1F1B's F/B order, rank r holding back r weight-gradient passes to fill its
    cool-down. Unit-cost bubble (p-1)/(3m+p-1) for m >= p (general T: (p-1)(T_F+T_B-T_W));
    peak activation p M_B, as 1F1B."""
    prog = Program(Placement.linear(p), m, name="zb-h1")
    for r in prog.ranks:
        fs, bs, ws = (prog.queue(r, k) for k in ("F", "B", "W"))
        warm = fs.take(p - 1 - r)
        prog.order(r, warm, after_each(alternate(fs, bs) + list(bs), ws, lag=r, on="B"))
    return prog.build()


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2: extra warm-up forwards (2(p-r)-1 on rank r) fill the bubble before the first B and
    2r held-back W passes fill the tail, turning the schedule into a parallelogram. Unit-cost
    bubble 0 for m >= 2p-1 (general T: (p-1)(T_F+T_B-2T_W)); peak activation (2p-1) M_B."""
    prog = Program(Placement.linear(p), m, name="zb-h2")
    for r in prog.ranks:
        fs, bs, ws = (prog.queue(r, k) for k in ("F", "B", "W"))
        warm = fs.take(2 * (p - r) - 1)
        prog.order(r, warm, after_each(alternate(bs, fs) + list(bs), ws, lag=2 * r, on="B"))
    return prog.build()


def zb_v(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """ZB-V: V placement (rank i holds stages i and 2p-1-i), B before F before W, W only when
    nothing else is ready, activation memory limited to 1F1B's p M_B. Near-zero bubble at
    1F1B's memory."""
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    policy = Policy(mem_limit=one_f_one_b_memory(placement, cost), reserve="auto")
    return policy_schedule(placement, m, policy, cost, name="zb-v")
