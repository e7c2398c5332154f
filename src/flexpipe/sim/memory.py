"""Memory over time per rank, from the op kinds' declared memory effects and the op times.
Vectorised with numpy: effects anchored on the op itself are gathered per (kind, stage); effects
anchored on another op (recompute releasing its forward's activations) go through a lookup."""

from __future__ import annotations

from operator import itemgetter

import numpy as np

from flexpipe.cost.model import CostModel
from flexpipe.ir.kinds import KindRegistry
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule

Curve = tuple[tuple[float, float], ...]


def memory_curves(schedule: Schedule, starts: tuple[tuple[float, ...], ...],
                  ends: tuple[tuple[float, ...], ...], cost: CostModel,
                  registry: KindRegistry) -> tuple[tuple[Curve, ...], tuple[float, ...]]:
    """Device memory as (time, value) steps per rank (activations and whatever the op kinds move),
    and static parameter memory per rank. At equal times, frees come before allocations."""
    anchored = _anchor_times(schedule, starts, ends, registry)
    dynamic: set[int] = set()
    curves: list[Curve] = []
    for r, ops in enumerate(schedule.ranks):
        times, deltas = _events(ops, starts[r], ends[r], cost, registry, anchored, dynamic)
        if times.size == 0:
            curves.append(((0.0, 0.0),))
            continue
        order = np.lexsort((deltas > 0, times))
        level = np.cumsum(deltas[order])
        curves.append(((0.0, 0.0), *zip(times[order].tolist(), level.tolist(), strict=True)))
    static = [0.0] * schedule.num_ranks
    for s, r in enumerate(schedule.placement.stage_rank):
        if s not in dynamic:
            static[r] += cost.stage(s).params
    return tuple(curves), tuple(static)


def _anchor_times(schedule: Schedule, starts: tuple[tuple[float, ...], ...],
                  ends: tuple[tuple[float, ...], ...],
                  registry: KindRegistry) -> dict[Op, tuple[float, float]]:
    """(start, end) of the ops that some memory effect is anchored on."""
    wanted = {e.anchor for k in schedule.kinds() for e in registry[k].memory if e.anchor}
    out = {}
    for r, ops in enumerate(schedule.ranks):
        for i, op in enumerate(ops):
            if op.kind in wanted:
                out[op] = (starts[r][i], ends[r][i])
    return out


def _events(ops: tuple[Op, ...], starts: tuple[float, ...], ends: tuple[float, ...],
            cost: CostModel, registry: KindRegistry, anchored: dict[Op, tuple[float, float]],
            dynamic: set[int]) -> tuple[np.ndarray, np.ndarray]:
    keys = list(map(itemgetter(0, 1), ops))
    uniq = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    codes = np.array(list(map(uniq.__getitem__, keys)), dtype=np.int64)
    st, en = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    slots: list[tuple[np.ndarray, np.ndarray]] = []
    extra_t: list[float] = []
    extra_d: list[float] = []
    for (kind, stage), u in uniq.items():
        effects = registry[kind].memory
        for j, eff in enumerate(effects):
            if eff.pool != "device":
                continue
            if eff.qty == "params":
                dynamic.add(stage)
            delta = eff.coeff * cost.stage(stage).mem(eff.qty)
            if eff.anchor is None:
                while len(slots) <= j:
                    slots.append((np.zeros(len(uniq)), np.zeros(len(uniq), dtype=bool)))
                slots[j][0][u] = delta
                slots[j][1][u] = eff.at == "start"
                continue
            for i in np.flatnonzero(codes == u).tolist():
                span = anchored.get(Op(eff.anchor, stage, ops[i].mb))
                if span is not None:
                    extra_t.append(span[0] if eff.at == "start" else span[1])
                    extra_d.append(delta)
    times = [np.where(at[codes], st, en) for _, at in slots]
    deltas = [d[codes] for d, _ in slots]
    t = np.concatenate([*times, np.asarray(extra_t, dtype=float)])
    d = np.concatenate([*deltas, np.asarray(extra_d, dtype=float)])
    keep = d != 0
    return t[keep], d[keep]
