"""A rank's recompute options and their peaks (``flexpipe.search.recompute``): every assignment
of nothing, SR or R to the rank's stages, priced from the cost model, and each one's activation
peak, read off the candidate's own memory curve without building or simulating the variants.

The ops of the candidates tried (F, B, W, BW) run one after another on their rank's compute
stream, so a rank's memory follows its op order: its curve is computed once
(``sim.memory.memory_curves``) with each op at its own place in that order. Under a plan, a
micro-batch of a recomputed stage holds what the plan leaves it (``held``) from the
end of its forward to the start of its recompute, right before its first backward, where it
is whole again; so at every point of the order the plan's level is the candidate's less the
savings of the micro-batches dropped there, and while a recompute pass runs the level is the
one before it, its own micro-batch whole again. The maximum over those points is the plan's
peak. The search simulates the plan it picks from these peaks and goes on by simulation where
the two disagree (which needs ties in time that this order has not), so what it reports is
always simulated."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flexpipe.cost.model import CostModel, StageCost
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.memory import memory_curves

BACKWARDS = ("B", "BW")
CHOICES = (None, "SR", "R")
Plan = tuple[tuple[int, str], ...]
"""(stage, SR or R) pairs."""


@dataclass(frozen=True)
class Option:
    """One rank's assignment: ``plan`` (stage, SR or R) and its priced time ``extra``."""

    plan: Plan
    extra: float


def recompute_time(st: StageCost, kind: str) -> float:
    """One ``kind`` (SR or R) pass's time on stage ``st`` (its fallback where unprofiled)."""
    return KINDS[kind].duration(st.time, st.has_time)


def rank_options(cost: CostModel, stages: Sequence[int], runs: int) -> list[Option]:
    """Every assignment of nothing, SR or R to ``stages``, cheapest first (module docstring)."""
    out = []
    for kinds in itertools.product(CHOICES, repeat=len(stages)):
        plan = tuple((s, k) for s, k in zip(stages, kinds, strict=True) if k is not None)
        extra = runs * sum(recompute_time(cost.stage(s), k) for s, k in plan)
        out.append(Option(plan, extra))
    return sorted(out, key=lambda o: (o.extra, len(o.plan), o.plan))


def least_plan(cost: CostModel, stages: Sequence[int], split: set[int]) -> Plan:
    """Per stage, the choice that holds least (the cheaper on a tie)."""
    out = []
    for s in stages:
        st = cost.stage(s)
        kind = min(CHOICES, key=lambda k: (held(st, k, s in split),
                                           0.0 if k is None else recompute_time(st, k)))
        if kind is not None:
            out.append((s, kind))
    return tuple(out)


def option_peaks(schedule: Schedule, cost: CostModel,
                 options: Sequence[Sequence[Plan]]) -> list[np.ndarray]:
    """Per rank, the peak under each of ``options[r]`` (plans of that rank's stages)."""
    starts = tuple(tuple(2.0 * i for i in range(len(ops))) for ops in schedule.ranks)
    ends = tuple(tuple(2.0 * i + 1 for i in range(len(ops))) for ops in schedule.ranks)
    curves, _ = memory_curves(schedule, starts, ends, cost, KINDS)
    split = {(op.stage, op.mb) for ops in schedule.ranks for op in ops if op.kind == "B"}
    out = []
    for r, ops in enumerate(schedule.ranks):
        stages = schedule.placement.rank_stages[r]
        levels, counts = _points(ops, curves[r], stages, split)
        saving = np.array([[_saving(cost, s, dict(plan).get(s), cls)
                            for s in stages for cls in (False, True)]
                           for plan in options[r]]).reshape(len(options[r]), 2 * len(stages))
        out.append((levels[:, None] - counts @ saving.T).max(axis=0))
    return out


def held(st: StageCost, kind: str | None, split: bool) -> float:
    """What one micro-batch holds on ``st`` from its forward to its recompute: ``act``
    without recompute, ``sr_kept`` under SR (``split``: its backward is B and W), the stage
    input under R."""
    if kind is None:
        return st.act
    return st.sr_kept(split) if kind == "SR" else st.input


def _saving(cost: CostModel, stage: int, kind: str | None, split: bool) -> float:
    """What one dropped micro-batch of ``stage`` does not hold under ``kind``."""
    st = cost.stage(stage)
    return st.act - held(st, kind, split)


def _points(ops: Sequence[Op], curve: Sequence[tuple[float, float]],
            stages: Sequence[int], split: set[tuple[int, int]]) -> tuple[np.ndarray,
                                                                         np.ndarray]:
    """The candidate's level at every point of the order (after each op's start and end,
    and while each first backward's recompute would run) and, at each, how many
    micro-batches of each (stage, fused or split) are dropped under a plan that recomputes
    them (module docstring)."""
    times = np.array([t for t, _ in curve])
    values = np.array([v for _, v in curve])
    col = {(s, cls): 2 * i + cls for i, s in enumerate(stages) for cls in (0, 1)}
    drops: list[tuple[float, float, int]] = []  # (from, to, column) in the order's times
    fwd: dict[tuple[int, int], float] = {}
    for i, op in enumerate(ops):
        key = (op.stage, op.mb)
        if op.kind == "F":
            fwd[key] = 2.0 * i + 1
        elif op.kind in BACKWARDS and key in fwd:
            drops.append((fwd.pop(key), 2.0 * i, col[(key[0], int(key in split))]))
    at = np.unique(np.concatenate([times, [2.0 * i - 1 for i in range(1, len(ops) + 1)]]))
    bumps = np.array([end - 1 for _, end, _ in drops])
    where = np.concatenate([at, bumps])
    level = values[np.searchsorted(times, where, side="right") - 1]
    counts = np.zeros((len(where), len(col)))
    for k, (start, end, c) in enumerate(drops):
        counts[:, c] += (where >= start) & (where < end)
        counts[len(at) + k, c] -= 1  # its own recompute runs: whole again
    return level, counts
