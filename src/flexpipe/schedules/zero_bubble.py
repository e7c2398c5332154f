"""Zero-bubble schedules (Qi et al., ICLR 2024): the backward split into B (input gradient) and
W (weight gradient), with W moved to fill bubbles."""

from __future__ import annotations

from functools import partial

from flexpipe.cost.model import CostModel
from flexpipe.dsl.order import after_each, alternate
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.dsl.program import Program
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.units import one_f_one_b_memory
from flexpipe.sim.engine import simulate


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
    """ZB-V (Qi et al., ICLR 2024, section 6): V placement (rank i holds stages i and 2p-1-i),
    activation memory capped at 1F1B's p M_B, list-scheduled with the pass priority
    F(up chunk) > F(down chunk) > B(down) > W(down) > B(up) > W(up), W only when nothing else
    can run. At T_F = T_B = T_W this is exactly zero bubble for m >= 2p (p = 2..16 tested) at
    peak p M_B; for fewer micro-batches the plain B > F > W order is kept when it is better."""
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    limit = one_f_one_b_memory(placement, cost)
    chunk_first = Policy(mem_limit=limit, reserve="auto", priority=partial(_zbv_rank, p))
    plain = Policy(mem_limit=limit, reserve="auto")
    tries = [policy_schedule(placement, m, pol, cost, name="zb-v") for pol in (chunk_first, plain)]
    return min(tries, key=lambda s: simulate(s, cost).metrics().bubble_rate)


ZBV_ORDER = {("F", 1): 0, ("F", 0): 1, ("B", 0): 2, ("W", 0): 3, ("B", 1): 4, ("W", 1): 5}


def _zbv_rank(p: int, op: Op) -> int:
    """ZB-V pass priority: chunk 0 is the way down (stages < p), chunk 1 the way up."""
    return ZBV_ORDER[(op.kind, int(op.stage >= p))]
