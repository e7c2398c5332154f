"""Compile a schedule for fast simulation: ops become integer ids ``(kind*S + stage)*M + mb`` and
dependencies become per-(kind, stage, rank) templates of (base id, transfer time), so the event
loop touches only lists and ints. Ops whose dependencies vary per micro-batch (optional needs
present for some micro-batches only, run spans, gates) get an explicit list from ``DepIndex``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import add, itemgetter

from flexpipe.cost.model import CostModel
from flexpipe.errors import ValidationError, Violation
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.kinds import KindRegistry, OpKind
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule

Dep = tuple[int, float]  # (base id, transfer time); a template's base is offset by the mb
Info = tuple[int, float, int, "tuple[Dep, ...] | None"]  # (base id, duration, stream, template)


@dataclass
class Compiled:
    """Integer-coded schedule, per rank: op ids, durations, stream indices, and per op either a
    template shared by its (kind, stage) or None with the explicit deps in ``explicit``."""

    kinds: list[str]
    num_stages: int
    microbatches: int
    ids: list[list[int]]
    durations: list[list[float]]
    streams: list[list[int]]
    templates: list[list[tuple[Dep, ...] | None]]
    explicit: list[dict[int, tuple[Dep, ...]]]
    stream_names: list[str]

    @property
    def size(self) -> int:
        """Number of possible op ids; the id ``size`` stands for a missing op."""
        return len(self.kinds) * self.num_stages * self.microbatches


def compile_schedule(schedule: Schedule, cost: CostModel, registry: KindRegistry) -> Compiled:
    """Build the integer form; ops out of range or repeated raise ``ValidationError``."""
    kinds = sorted(schedule.kinds())
    specs = {k: registry[k] for k in kinds}
    S, M = schedule.num_stages, schedule.microbatches
    _check_ranges(schedule, S, M)
    counts: Counter[tuple[str, int]] = Counter()
    for rank in schedule.ranks:
        counts.update(map(itemgetter(0, 1), rank))
    gated = {k for spec in specs.values() for g in spec.gates for k in g.kinds}
    streams: dict[str, int] = {"compute": 0}
    comp = Compiled(kinds, S, M, [], [], [], [], [], [])
    index: DepIndex | None = None
    for r, ops in enumerate(schedule.ranks):
        info: dict[tuple[str, int], Info] = {}
        for key in set(map(itemgetter(0, 1), ops)):
            k, s = key
            spec, st = specs[k], cost.stage(s)
            tpl = None if k in gated else _template(k, s, r, spec, schedule, cost, counts, kinds)
            info[key] = ((kinds.index(k) * S + s) * M, spec.duration(st.time, st.has_time),
                         streams.setdefault(spec.stream, len(streams)), tpl)
        rows = list(map(info.__getitem__, map(itemgetter(0, 1), ops)))
        comp.ids.append(list(map(add, map(itemgetter(0), rows), map(itemgetter(2), ops))))
        comp.durations.append(list(map(itemgetter(1), rows)))
        comp.streams.append(list(map(itemgetter(2), rows)))
        comp.templates.append(list(map(itemgetter(3), rows)))
        explicit: dict[int, tuple[Dep, ...]] = {}
        for i, row in enumerate(rows):
            if row[3] is None:
                index = index or DepIndex(schedule, registry)
                explicit[i] = _explicit(ops[i], r, index, cost, schedule, kinds, comp.size)
        comp.explicit.append(explicit)
    comp.stream_names = list(streams)
    return comp


def _check_ranges(schedule: Schedule, S: int, M: int) -> None:
    """Every stage and micro-batch in range, no op twice; otherwise a ValidationError."""
    total = sum(len(r) for r in schedule.ranks)
    stage, mb = itemgetter(1), itemgetter(2)
    in_range = all(not rank or (min(map(stage, rank)) >= 0 and max(map(stage, rank)) < S
                                and min(map(mb, rank)) >= 0 and max(map(mb, rank)) < M)
                   for rank in schedule.ranks)
    if in_range and len(set().union(*schedule.ranks)) == total:
        return
    seen: set[Op] = set()
    for r, i, op in schedule.ops():
        why = ""
        if not 0 <= op.stage < S:
            why = f"stage {op.stage} is outside 0..{S - 1}"
        elif not 0 <= op.mb < M:
            why = f"micro-batch {op.mb} is outside 0..{M - 1}"
        elif op in seen:
            why = "op appears more than once"
        if why:
            rule = "range" if "outside" in why else "duplicate"
            raise ValidationError([Violation(rule, why, r, i, str(op))])
        seen.add(op)


def _transfer(cost: CostModel, schedule: Schedule, dep_stage: int, stage: int, src: int,
              dst: int) -> float:
    if src == dst:
        return 0.0
    producer = dep_stage if dep_stage in schedule.graph.preds[stage] else stage
    return cost.comm.time(src, dst, cost.stage(producer).out_bytes)


def _template(kind: str, stage: int, r: int, spec: OpKind, schedule: Schedule, cost: CostModel,
              counts: dict[tuple[str, int], int], kinds: list[str]) -> tuple[Dep, ...] | None:
    """Deps shared by every micro-batch of (kind, stage) on rank r, or None when they vary."""
    S, M = schedule.num_stages, schedule.microbatches
    graph, stage_rank = schedule.graph, schedule.placement.stage_rank
    out: list[Dep] = []
    for need in spec.needs:
        if need.span != "one":
            return None
        table = {"same": (stage,), "pred": graph.preds[stage], "succ": graph.succs[stage]}
        for s in table[need.where]:
            full = [k for k in need.kinds if counts.get((k, s), 0) == M]
            if any(0 < counts.get((k, s), 0) < M for k in need.kinds):
                return None
            if not full:
                if need.optional:
                    continue
                return None  # missing everywhere: the explicit path names it
            base = (kinds.index(full[0]) * S + s) * M
            out.append((base, _transfer(cost, schedule, s, stage, stage_rank[s], r)))
    return tuple(out)


def _explicit(op: Op, r: int, index: DepIndex, cost: CostModel, schedule: Schedule,
              kinds: list[str], missing: int) -> tuple[Dep, ...]:
    S, M = schedule.num_stages, schedule.microbatches
    stage_rank = schedule.placement.stage_rank
    out = []
    for d in index.needs(op):
        if not index.has(d):
            out.append((missing, 0.0))
            continue
        ident = (kinds.index(d.kind) * S + d.stage) * M + d.mb
        out.append((ident, _transfer(cost, schedule, d.stage, op.stage, stage_rank[d.stage], r)))
    return tuple(out)
