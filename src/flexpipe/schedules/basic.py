"""The first schedules as plain generator functions: GPipe, 1F1B and ZB-H1 on a linear placement.
Each is a pure function (p, m) -> Schedule."""

from __future__ import annotations

from flexpipe.errors import ConfigError
from flexpipe.ir.op import BW, B, F, Op, W
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule


def _check(p: int, m: int) -> None:
    for name, value in (("p", p), ("m", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all fused backwards. Unit-cost bubble
    (p-1)/(m+p-1); peak activation m micro-batches on every rank."""
    _check(p, m)
    ranks = [[F(r, j) for j in range(m)] + [BW(r, j) for j in range(m)] for r in range(p)]
    return Schedule.build(ranks, Placement.linear(p), m, name="gpipe")


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): rank r warms up with p-1-r forwards, then
    alternates one forward and one fused backward. Bubble as GPipe; peak min(p, m) on rank 0."""
    _check(p, m)
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops: list[Op] = [F(r, j) for j in range(warm)]
        for j in range(m - warm):
            ops += [F(r, warm + j), BW(r, j)]
        ops += [BW(r, j) for j in range(m - warm, m)]
        ranks.append(ops)
    return Schedule.build(ranks, Placement.linear(p), m, name="1f1b")


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, zero-bubble): 1F1B's F/B order with the backward split into B and
    W, and rank r holding back r weight-gradient passes to fill its cool-down bubbles. Unit-cost
    bubble (p-1)/(3m+p-1) for m >= p; peak activation p (as 1F1B) counting memory until W."""
    _check(p, m)
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops: list[Op] = [F(r, j) for j in range(warm)]
        pending: list[int] = []
        for j in range(m):
            if warm + j < m:
                ops.append(F(r, warm + j))
            ops.append(B(r, j))
            pending.append(j)
            if len(pending) > r:
                ops.append(W(r, pending.pop(0)))
        ops += [W(r, j) for j in pending]
        ranks.append(ops)
    return Schedule.build(ranks, Placement.linear(p), m, name="zb-h1")
