"""Memory over time per rank, from the op kinds' declared memory effects and the op times.
Vectorised with numpy: effects anchored on the op itself are gathered per (kind, stage); effects
anchored on another op (recompute releasing its forward's activations) go through a lookup."""

from __future__ import annotations

import numpy as np

from flexpipe.cost.model import CostModel
from flexpipe.ir.kinds import KindRegistry, MemEffect
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule

Curve = tuple[tuple[float, float], ...]


def memory_curves(schedule: Schedule, starts: tuple[tuple[float, ...], ...],
                  ends: tuple[tuple[float, ...], ...], cost: CostModel,
                  registry: KindRegistry, keys: list[np.ndarray] | None = None,
                  kinds: list[str] | None = None) -> tuple[tuple[Curve, ...], tuple[float, ...]]:
    """Device memory as (time, value) steps per rank (activations and whatever the op kinds move),
    and static parameter memory per rank. At equal times, frees come before allocations.
    ``keys``/``kinds``: each op's (kind index * S + stage) per rank, as the compiler made them."""
    if keys is None or kinds is None:
        kinds = sorted(schedule.kinds())
        kidx = {k: i for i, k in enumerate(kinds)}
        S = schedule.num_stages
        keys = [np.array([kidx[o.kind] * S + o.stage for o in ops], dtype=np.int64)
                for ops in schedule.ranks]
    table = _effects(schedule, cost, registry, kinds, keys)
    anchored = _anchor_times(schedule, starts, ends, registry)
    curves: list[Curve] = []
    for r, ops in enumerate(schedule.ranks):
        times, deltas = _events(ops, keys[r], starts[r], ends[r], table, anchored, cost,
                                schedule.placement.stage_rank)
        shared = _held_once(ops, ends[r], cost, schedule.placement.stage_rank)
        if shared[0]:
            times = np.concatenate([times, np.asarray(shared[0], dtype=float)])
            deltas = np.concatenate([deltas, np.asarray(shared[1], dtype=float)])
        if times.size == 0:
            curves.append(((0.0, 0.0),))
            continue
        order = np.lexsort((deltas > 0, times))
        level = np.cumsum(deltas[order])
        curves.append(((0.0, 0.0), *zip(times[order].tolist(), level.tolist(), strict=True)))
    static = [0.0] * schedule.num_ranks
    for s, r in enumerate(schedule.placement.stage_rank):
        if s not in table.dynamic:
            static[r] += cost.stage(s).params
    return tuple(curves), tuple(static)


class _Table:
    """Self-anchored memory deltas per effect slot and key (kind*S+stage), the anchored effects
    by kind, and the stages whose parameters the schedule moves (FSDP)."""

    def __init__(self, slots: int, size: int) -> None:
        self.delta = np.zeros((slots, size))
        self.at_start = np.zeros((slots, size), dtype=bool)
        self.anchored: dict[str, list[MemEffect]] = {}
        self.dynamic: set[int] = set()
        self.moves = np.zeros((slots, size), dtype=bool)
        """Which deltas move a stage's parameters (AG gathers, RS frees)."""


def _effects(schedule: Schedule, cost: CostModel, registry: KindRegistry,
             kinds: list[str], keys: list[np.ndarray]) -> _Table:
    S, stage_rank = schedule.num_stages, schedule.placement.stage_rank
    used = np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)
    specs = [registry[k] for k in kinds]
    table = _Table(max((len(sp.memory) for sp in specs), default=0), len(kinds) * S)
    for k, spec in enumerate(specs):
        for j, eff in enumerate(spec.memory):
            if eff.pool != "device":
                continue
            if eff.qty == "params":  # stages where this kind runs manage their own params
                table.dynamic.update(int(u) % S for u in used if u // S == k)
            if eff.anchor is not None:
                table.anchored.setdefault(kinds[k], []).append(eff)
                continue
            for s in range(S):
                table.delta[j, k * S + s] = eff.coeff * cost.mem_on(s, eff.qty, stage_rank)
                table.at_start[j, k * S + s] = eff.at == "start"
                table.moves[j, k * S + s] = eff.qty == "params"
    return table


def _anchor_times(schedule: Schedule, starts: tuple[tuple[float, ...], ...],
                  ends: tuple[tuple[float, ...], ...],
                  registry: KindRegistry) -> dict[Op, tuple[float, float]]:
    """(start, end) of the ops that some memory effect is anchored on."""
    wanted = {e.anchor for k in schedule.kinds() for e in registry[k].memory if e.anchor}
    out: dict[Op, tuple[float, float]] = {}
    for r, ops in enumerate(schedule.ranks if wanted else ()):
        for i, op in enumerate(ops):
            if op.kind in wanted:
                out[op] = (starts[r][i], ends[r][i])
    return out


def _gathers_once(ops: tuple[Op, ...], key: np.ndarray, table: _Table,
                  deltas: list[np.ndarray], ends: np.ndarray,
                  ) -> tuple[list[np.ndarray], tuple[list[float], list[float]]]:
    """The parameter moves of a rank as FSDP does them: a stage's parameters are gathered once
    however many gathers are open (an AG while one is open adds nothing) and freed when the
    last one closes (an RS that leaves one open frees nothing); their unsharded gradient (as
    large) exists from the first weight gradient (W or BW) while gathered to the next RS,
    which reduce-scatters it, nested or not.
    (deltas without the nested moves, (times, deltas) of the gradient)."""
    moves = [table.moves[j][key] for j in range(len(table.delta))]
    nested = np.zeros(len(ops), dtype=bool)
    open_: dict[int, int] = {}
    size: dict[int, float] = {}
    held: set[int] = set()
    times: list[float] = []
    amounts: list[float] = []
    for i, op in enumerate(ops):
        change = sum(float(d[i]) for d, m in zip(deltas, moves, strict=True) if m[i])
        s = op.stage
        if change > 0:
            nested[i] = open_.get(s, 0) > 0
            open_[s], size[s] = open_.get(s, 0) + 1, change
        elif change < 0:
            open_[s] = open_.get(s, 0) - 1
            nested[i] = open_[s] > 0
            if s in held:  # every RS reduce-scatters and frees the gradient
                held.discard(s)
                times.append(float(ends[i]))
                amounts.append(-size[s])
        elif op.kind in ("W", "BW") and open_.get(s, 0) > 0 and s not in held:
            held.add(s)
            times.append(float(ends[i]))
            amounts.append(size[s])
    kept = [np.where(m & nested, 0.0, d) for d, m in zip(deltas, moves, strict=True)]
    return kept, (times, amounts)


def _held_once(ops: tuple[Op, ...], ends: tuple[float, ...], cost: CostModel,
               stage_rank: tuple[int, ...]) -> tuple[list[float], list[float]]:
    """(times, deltas) that count once what a consumer's W holds of its producer's outputs
    on the same rank (``Edge.kept_w``): its B adds them to its M_W while the producer's M_B
    still holds them, so they come off at the consumer's B and back at the producer's
    backward or the consumer's W, whichever ends first (then only one of the two holds
    them). A consumer whose backward is fused (no W) holds nothing past it."""
    edges = [e for e in cost.edges
             if e.kept_w > 0 and stage_rank[e.producer] == stage_rank[e.consumer]]
    if not edges:
        return [], []
    end = {(op.kind, op.stage, op.mb): float(at) for op, at in zip(ops, ends, strict=True)}
    times: list[float] = []
    deltas: list[float] = []
    for e in edges:
        for (kind, stage, mb), at in end.items():
            w = end.get(("W", stage, mb))
            if kind != "B" or stage != e.consumer or w is None:
                continue
            back = end.get(("B", e.producer, mb), end.get(("BW", e.producer, mb), w))
            times += [at, min(w, back)]
            deltas += [-e.kept_w, e.kept_w]
    return times, deltas


def _events(ops: tuple[Op, ...], key: np.ndarray, starts: tuple[float, ...],
            ends: tuple[float, ...], table: _Table, anchored: dict[Op, tuple[float, float]],
            cost: CostModel, stage_rank: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    st, en = np.asarray(starts, dtype=float), np.asarray(ends, dtype=float)
    times = [np.where(table.at_start[j][key], st, en) for j in range(len(table.delta))]
    deltas = [table.delta[j][key] for j in range(len(table.delta))]
    grads: tuple[list[float], list[float]] = ([], [])
    if table.moves.any():
        deltas, grads = _gathers_once(ops, key, table, deltas, en)
    extra_t: list[float] = []
    extra_d: list[float] = []
    split = {(op.stage, op.mb) for op in ops if op.kind == "B"} if table.anchored else set()
    for op in ops if table.anchored else ():
        for eff in table.anchored.get(op.kind, ()):
            span = anchored.get(Op(eff.anchor or "", op.stage, op.mb))
            if span is not None:
                qty = _per_mb(eff.qty, (op.stage, op.mb) in split)
                extra_t.append(span[0] if eff.at == "start" else span[1])
                extra_d.append(eff.coeff * cost.mem_on(op.stage, qty, stage_rank))
    t = np.concatenate([*times, np.asarray(extra_t + grads[0], dtype=float)])
    d = np.concatenate([*deltas, np.asarray(extra_d + grads[1], dtype=float)])
    keep = d != 0
    return t[keep], d[keep]


def _per_mb(qty: str, split: bool) -> str:
    """The quantity an anchored effect moves for one micro-batch: what selective recompute
    drops (``sr``) differs where the micro-batch's backward is split (``sr_w``: its forward
    records for W what SR then keeps)."""
    return "sr_w" if qty == "sr" and split else qty
