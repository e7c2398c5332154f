"""Zero-bubble schedules (Qi et al., ICLR 2024): the backward split into B (input gradient) and
W (weight gradient), with W moved to fill bubbles."""

from __future__ import annotations

import contextlib
from functools import partial

from flexpipe.cost.model import CostModel
from flexpipe.dsl.order import Passes, after_each, alternate
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.dsl.program import Program
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import remembered
from flexpipe.schedules.units import one_f_one_b_memory
from flexpipe.schedules.vgreedy import v_adaptive
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


@remembered
def zb_v(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, section 6): V placement (rank i holds stages i and 2p-1-i),
    activation memory capped at 1F1B's p M_B. Four constructions, the best under ``cost``
    (default unit times) kept, the first on ties: the paper's fixed pattern (``zb_v_pattern``,
    which stays close to zero bubble when T_F, T_B, T_W differ and links have latency), a list
    schedule with the pass priority F(up chunk) > F(down) > B(down) > W(down) > B(up) > W(up)
    (W only when nothing else can run), the plain B > F > W list schedule, and the paper's
    cost-aware greedy (``vgreedy.v_adaptive`` at p M_B, which times every pass with ``cost``).
    At T_F = T_B = T_W the result is exactly zero bubble for m >= 2p (p = 2..16 tested) at
    peak p M_B."""
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    limit = one_f_one_b_memory(placement, cost)
    chunk_first = Policy(mem_limit=limit, reserve="auto", priority=partial(_zbv_rank, p))
    plain = Policy(mem_limit=limit, reserve="auto")
    tries = [zb_v_pattern(p, m)] if m >= 2 * p else []
    tries += [policy_schedule(placement, m, pol, cost, name="zb-v") for pol in (chunk_first, plain)]
    with contextlib.suppress(InfeasibleError):  # a profiled cost can sit below its floor
        tries.append(v_adaptive(p, m, cost, mem_limit=limit).renamed("zb-v"))
    return min(tries, key=lambda s: simulate(s, cost).metrics().bubble_rate)


def zb_v_pattern(p: int, m: int) -> Schedule:
    """The fixed ZB-V order of the paper (figure 8), for m >= 2p. Rank i warms up with
    2(p-i)-1 forwards of its down chunk (stage i) and i pairs (up forward, down forward); then
    p-i units F+B of its up chunk, then down and up units in turn. Each B is followed by its W,
    except after the rank's last forward, where W trails B by 2i passes so that the gradients
    the earlier ranks wait for go first."""
    if m < 2 * p:
        raise ConfigError(f"zb-v pattern needs m >= 2p = {2 * p} micro-batches, got {m}")
    prog = Program(Placement.vshape(p), m, name="zb-v")
    for i in prog.ranks:
        down, up = i, 2 * p - 1 - i
        f0, f1, b0, b1 = (prog.queue(i, k, stages=[s]) for k, s in
                          (("F", down), ("F", up), ("B", down), ("B", up)))
        fb = f0.take(2 * (p - i) - 1)
        for _ in range(i):
            fb += f1.take(1) + f0.take(1)
        for _ in range(p - i):
            fb += f1.take(1) + b1.take(1)
        while b0 or b1:
            fb += f0.take(1) + b0.take(1) + f1.take(1) + b1.take(1)
        cut = max(k for k, op in enumerate(fb) if op.kind == "F") + 1
        prog.order(i, _with_w(fb[:cut], 0), _with_w(fb[cut:], 2 * i))
    return prog.build()


def _with_w(passes: list[Op], lag: int) -> list[Op]:
    """``passes`` with each B's W after it, the first ``lag`` held back to the end."""
    ws = Passes(Op("W", op.stage, op.mb) for op in passes if op.kind == "B")
    return after_each(passes, ws, lag=lag, on="B")


ZBV_ORDER = {("F", 1): 0, ("F", 0): 1, ("B", 0): 2, ("W", 0): 3, ("B", 1): 4, ("W", 1): 5}


def _zbv_rank(p: int, op: Op) -> int:
    """ZB-V pass priority: chunk 0 is the way down (stages < p), chunk 1 the way up."""
    return ZBV_ORDER[(op.kind, int(op.stage >= p))]
