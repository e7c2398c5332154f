"""Compile a schedule for fast simulation: ops become integer ids ``(kind*S + stage)*M + mb`` and
dependencies become per-(kind, stage, rank) templates of (base id, transfer time), so the event
loop touches only lists and ints. Ops whose dependencies vary per micro-batch (optional needs
present for some micro-batches only, run spans, gates, gang stages) get an explicit list from
``DepIndex``: a gang op waits for its peers' inputs and for the op before each peer on the
peer's rank, so all members of a gang start at the same time.

A transfer that occupies its link (finite bandwidth, bytes > 0) becomes a message: an extra id
(a slot after the ops' ids) whose end is the arrival, set by the loop when the producer ends; the
producer's ``sends`` list it with its link, occupancy and latency. One output goes once to each
remote rank, however many ops there consume it. Pure delays stay (producer id, delay) deps; so
does an input that a receive gating the op brings (lowered schedules: the send's message carries
it, once).

An op's duration is its stage's time for its kind; where the cost model gives a stage times by
context, a compute op takes the one of its context (``_in_context``): the ``cold`` one
(``StageCost.switched_time``) when another stage's compute op ran on its rank since the
previous op of its kind and stage (on a CPU the other stage's data then holds the caches);
else the ``fused`` one when its micro-batch's backward is fused (no B: its forward records
nothing for W), or the ``after_w`` one right after its own stage's W
(``StageCost.timer``).

Where the links have a posting cost (``Comm.post``), a compute op carries host time: before it,
one post per receive that gates it (the compute thread posts them once it is free, and the op
starts after them); after it, one per send of its outputs (its end, and the data's departure,
come after them). The receives and sends are where the lowering puts them
(``flexpipe.ir.lower``), so a schedule and its lowered form pay the same."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from flexpipe.cost.model import CONTEXTS, CostModel, StageCost
from flexpipe.errors import ValidationError, Violation
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.kinds import KindRegistry, OpKind
from flexpipe.ir.lower import COMM_KINDS, comm_stages, receive_for, send_after
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.quick import guard
from flexpipe.sim.slots import pair_slots

SPLIT, WEIGHT = "B", "W"
"""The kinds of a split backward: B (a micro-batch that has one records its forward for W) and
W (the weight pass, after which a forward of its stage takes its ``after_w`` time)."""

Dep = tuple[int, float]  # (base id, transfer time); a template's base is offset by the mb
Hop = tuple[int, int, float]  # (sender rank, receiver rank, link occupancy) of a transfer
Need = tuple[int, float, Hop | None]  # (base id, delay or latency, the hop when it holds a link)
Send = tuple[int, int, float, float]  # (message slot, link index, occupancy, latency)
Columns = tuple[np.ndarray, np.ndarray, np.ndarray]  # one rank's kind index, stage, mb per op


@dataclass
class Compiled:
    """Integer-coded schedule, per rank: op ids, durations, stream indices, and per op its deps
    as (base id, transfer time) plus an offset added to every base: the op's micro-batch when
    the deps are a template shared by its (kind, stage), 0 when they are explicit ids.
    ``keys[r]`` holds each op's (kind index * S + stage), reused by the memory pass.
    ``sends[r][i]``: the messages op i puts on links when it ends (None when no transfer
    occupies a link); ``slots`` message ids follow the ops' ids, over ``links`` links."""

    kinds: list[str]
    num_stages: int
    microbatches: int
    ids: list[list[int]]
    durations: list[list[float]]
    streams: list[list[int]]
    deps: list[list[tuple[Dep, ...]]]
    offsets: list[list[int]]
    stream_names: list[str]
    keys: list[np.ndarray]
    sends: list[list[tuple[Send, ...]]] | None = None
    slots: int = 0
    links: int = 0
    host: list[list[tuple[float, float]]] | None = None
    """Per rank and op, the compute thread's posting time (before, after) it; None: none."""
    pairs: list[frozenset[int]] | None = None
    """Per rank, the positions that start an overlapped pair (the pair's second op follows;
    both carry the slot's duration); None: the schedule has no pairs."""

    @property
    def size(self) -> int:
        """Number of possible op ids; the id ``size`` stands for a missing op."""
        return len(self.kinds) * self.num_stages * self.microbatches


def _columns(ops: tuple[Op, ...], kidx: dict[str, int]) -> tuple[np.ndarray, np.ndarray,
                                                                  np.ndarray]:
    """Kind index, stage and micro-batch of every op, as integer arrays."""
    if not ops:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    kinds, stages, mbs = zip(*ops, strict=True)
    return (np.fromiter(map(kidx.__getitem__, kinds), np.int64, len(ops)),
            np.fromiter(stages, np.int64, len(ops)), np.fromiter(mbs, np.int64, len(ops)))


def compile_schedule(schedule: Schedule, cost: CostModel, registry: KindRegistry,
                     columns: Sequence[Columns] | None = None) -> Compiled:
    """Build the integer form; ops out of range or repeated raise ``ValidationError``, a schedule
    too big for memory ``ConfigError`` (``flexpipe.sim.quick.guard``). ``columns``: each
    rank's (kind index in sorted kinds, stage, mb) arrays when the caller has them already."""
    kinds = sorted(schedule.kinds())
    guard(schedule, kinds)
    kidx = {k: i for i, k in enumerate(kinds)}
    specs = [registry[k] for k in kinds]
    S, M = schedule.num_stages, schedule.microbatches
    cols = list(columns) if columns is not None else [_columns(ops, kidx)
                                                      for ops in schedule.ranks]
    _check_ranges(schedule, cols, S, M)
    keys = [k * S + st for k, st, _ in cols]
    counts: np.ndarray | list[int] = (
        np.bincount(np.concatenate(keys), minlength=len(kinds) * S) if keys else [])
    count = {(kinds[key // S], key % S): int(c) for key, c in enumerate(counts) if c}
    gated = {k for spec in specs for g in spec.gates for k in g.kinds}
    streams: dict[str, int] = {"compute": 0}
    contexts = any(getattr(st, t) for st in cost.stages for t in CONTEXTS)
    comp = Compiled(kinds, S, M, [], [], [], [], [], [], keys)
    where = _positions(keys, cols, comp.size, M)
    links = _Links(comp.size, M)
    index: DepIndex | None = None
    for r, (key, (_k, _s, mb)) in enumerate(zip(keys, cols, strict=True)):
        uniq, inverse = np.unique(key, return_inverse=True)
        inv = inverse.ravel()
        durs, strs = [], []
        tpls: list[tuple[Dep, ...] | None] = []
        for j, u in enumerate(uniq.tolist()):
            k, s = divmod(u, S)
            spec, st = specs[k], cost.stage(s)
            alone = len(schedule.graph.gang_of[s]) == 1
            tpl = None if kinds[k] in gated or not alone else _template(
                kinds[k], s, r, spec, schedule, cost, count, kinds)
            at = np.flatnonzero(inv == j)
            tpls.append(None if tpl is None else tuple(
                links.dep(need, need[0] + mb[at]) for need in _prune(
                    tpl, r, at, mb, where, [specs[b // (S * M)].stream for b, _, _ in tpl],
                    spec.stream)))
            durs.append(spec.duration(st.time, st.has_time))
            strs.append(streams.setdefault(spec.stream, len(streams)))
        comp.ids.append((key * M + mb).tolist())
        comp.durations.append(np.asarray(durs, dtype=float)[inv].tolist())
        comp.streams.append(np.asarray(strs, dtype=np.int64)[inv].tolist())
        if contexts:
            _in_context(comp.durations[-1], comp.streams[-1], _k.tolist(), _s.tolist(),
                        mb.tolist(), specs, cost)
        deps: list = list(map(tpls.__getitem__, inv.tolist()))
        offsets = mb.tolist()
        for i in (i for i, t in enumerate(deps) if t is None) if None in tpls else ():
            index = index or DepIndex(schedule, registry)
            deps[i] = tuple(links.dep(need, (need[0],)) for need in _explicit(
                schedule.ranks[r][i], r, index, cost, schedule, kinds, comp.size))
            offsets[i] = 0
        comp.deps.append(deps)
        comp.offsets.append(offsets)
    comp.stream_names = list(streams)
    links.fill(comp)
    if cost.comm.post > 0:
        comp.host = _host(schedule, cost.comm.post, registry, bool(set(kinds) & set(COMM_KINDS)))
    if schedule.overlaps:
        comp.pairs = pair_slots(schedule, cost, comp.durations)
    return comp


def _host(schedule: Schedule, post: float, registry: KindRegistry,
          lowered: bool) -> list[list[tuple[float, float]]]:
    """Per rank and op, the posting time (before, after) it on the compute thread: a
    receive's before the next compute op, a send's after the last one. A ``lowered``
    schedule has its sends and receives in its lists; otherwise they are the ones lowering
    would add."""
    if not lowered:
        where = comm_stages(schedule)
        return [[(post if receive_for(op, where) else 0.0,
                  post if send_after(op, where) else 0.0) for op in ops]
                for ops in schedule.ranks]
    out = []
    for ops in schedule.ranks:
        row = [(0.0, 0.0)] * len(ops)
        pending, last = 0.0, None
        for i, op in enumerate(ops):
            stream = registry[op.kind].stream
            if stream == "recv":
                pending += post
            elif stream == "send" and last is not None:
                row[last] = (row[last][0], row[last][1] + post)
            elif stream == "compute":
                row[i], pending, last = (pending, 0.0), 0.0, i
        out.append(row)
    return out


class _Links:
    """The messages of transfers that occupy a link: a block of M slots per (producer kind and
    stage, receiver rank, occupancy), so a template's slot base is offset by the mb like its
    producer's; and per producer id the messages it sends, each once, in the order first met."""

    def __init__(self, size: int, M: int) -> None:
        self.size, self.M = size, M
        self.blocks: dict[tuple[int, int, float], int] = {}
        self.index: dict[tuple[int, int], int] = {}
        self.sends: dict[int, dict[int, Send]] = {}

    def dep(self, need: Need, producers: Iterable[int]) -> Dep:
        """The dep for ``need``: as is when it holds no link, else on its message slot, which
        ``producers`` (the producer ids it stands for) send."""
        base, delay, hop = need
        if hop is None:
            return base, delay
        src, dst, busy = hop
        key = base // self.M
        block = self.blocks.setdefault((key, dst, busy), len(self.blocks))
        shift = self.size + 1 + block * self.M - key * self.M
        link = self.index.setdefault((src, dst), len(self.index))
        for p in producers:
            slot = int(p) + shift
            self.sends.setdefault(int(p), {})[slot] = (slot, link, busy, delay)
        return base + shift, 0.0

    def fill(self, comp: Compiled) -> None:
        """Record the sends of every op (per link, the smaller message first, so the order does
        not depend on which op's dependencies were compiled first), the slot count and the link
        count in ``comp``."""
        if not self.sends:
            return
        get = self.sends.get
        comp.sends = [[tuple(sorted(get(i, {}).values(), key=lambda s: (s[1], s[2])))
                       for i in ids] for ids in comp.ids]
        comp.slots, comp.links = len(self.blocks) * self.M, len(self.index)


def _in_context(durs: list[float], streams: list[int], kinds: list[int], stages: list[int],
                mbs: list[int], specs: Sequence[OpKind], cost: CostModel) -> None:
    """In place: a compute op lasts its stage's ``switched_time`` (cold) when a compute op of
    another stage ran on its rank since the previous op of its own kind and stage (the caches
    then hold the other stage's data), or, being the first of its kind and stage, when it
    follows another stage's op. A V-shape's ranks alternate their two stages, so nearly all
    their passes run cold; a rank that runs one stage's passes in a row (looped
    breadth-first) runs the rest of the row hot. A hot op takes its ``fused`` time when its
    micro-batch has no B on the rank (its backward is one BW), its ``after_w`` time when the
    rank's previous compute op is its own stage's W (``StageCost.timer``)."""
    last_kind: dict[tuple[int, int], int] = {}  # position of each (kind, stage)'s last op
    last_stage: dict[int, int] = {}  # position of each stage's last compute op
    split = {(st, mb) for k, st, mb in zip(kinds, stages, mbs, strict=True)
             if specs[k].name == SPLIT}
    weight = next((j for j, spec in enumerate(specs) if spec.name == WEIGHT), -1)
    memo: dict[tuple[int, int, str], float] = {}
    prev = (-1, -1)  # (kind, stage) of the rank's previous compute op
    for i, (stream, k, st) in enumerate(zip(streams, kinds, stages, strict=True)):
        if stream != 0:
            continue
        # the first of its kind and stage: cold when another stage ran after its stage's last
        since = last_kind.get((k, st), last_stage.get(st, -1))
        if any(at > since for other, at in last_stage.items() if other != st):
            context: str | None = "cold"
        elif (st, mbs[i]) not in split:
            context = "fused"
        else:
            context = "after_w" if prev == (weight, st) else None
        if context is not None:
            durs[i] = _timed(memo, (k, st, context), specs[k], cost.stage(st))
        last_kind[(k, st)] = last_stage[st] = i
        prev = (k, st)


def _timed(memo: dict[tuple[int, int, str], float], key: tuple[int, int, str], spec: OpKind,
           stage: StageCost) -> float:
    """``spec``'s duration on ``stage`` in the context ``key`` names, computed once per
    (kind, stage, context)."""
    if key not in memo:
        memo[key] = spec.duration(stage.timer(key[2]), stage.has_time)
    return memo[key]


def _positions(keys: list[np.ndarray], cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
               size: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank and position of every op id (-1 where no op has that id)."""
    rank_of = np.full(size + 1, -1, dtype=np.int64)
    pos_of = np.full(size + 1, -1, dtype=np.int64)
    for r, (key, (_k, _s, mb)) in enumerate(zip(keys, cols, strict=True)):
        ids = key * M + mb
        rank_of[ids] = r
        pos_of[ids] = np.arange(len(ids))
    return rank_of, pos_of


def _prune(tpl: tuple[Need, ...], r: int, at: np.ndarray, mb: np.ndarray,
           where: tuple[np.ndarray, np.ndarray], dep_streams: list[str],
           stream: str) -> tuple[Need, ...]:
    """Drop template deps the rank's own order already enforces: a dep on the same rank and
    stream placed earlier ends before this op starts, since a stream runs one op at a time."""
    rank_of, pos_of = where
    keep = []
    for need, dep_stream in zip(tpl, dep_streams, strict=True):
        base, comm, hop = need
        ids = base + mb[at]
        implied = (comm == 0.0 and hop is None and dep_stream == stream
                   and bool(np.all(rank_of[ids] == r)) and bool(np.all(pos_of[ids] < at)))
        if not implied:
            keep.append(need)
    return tuple(keep)


def _check_ranges(schedule: Schedule, cols: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  S: int, M: int) -> None:
    """Every stage and micro-batch in range, no op twice; otherwise a ValidationError."""
    in_range = all(st.size == 0 or (st.min() >= 0 and st.max() < S and mb.min() >= 0
                                    and mb.max() < M) for _k, st, mb in cols)
    if in_range:
        ids = [(k * S + st) * M + mb for k, st, mb in cols if k.size]
        if not ids or np.bincount(np.concatenate(ids)).max() <= 1:
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


def _transfer(cost: CostModel, schedule: Schedule, base: int, dep_stage: int, stage: int,
              src: int, dst: int) -> Need:
    """The need on id ``base`` from ``src`` to ``dst``: a pure delay, or a hop holding the link."""
    if src == dst:
        return base, 0.0, None
    nbytes = cost.hop(dep_stage, stage, dep_stage in schedule.graph.preds[stage])
    lat, busy = cost.comm.link(src, dst, nbytes)
    return (base, lat, (src, dst, busy)) if busy > 0.0 else (base, lat + busy, None)


def _template(kind: str, stage: int, r: int, spec: OpKind, schedule: Schedule, cost: CostModel,
              counts: dict[tuple[str, int], int], kinds: list[str]) -> tuple[Need, ...] | None:
    """Deps shared by every micro-batch of (kind, stage) on rank r, or None when they vary."""
    S, M = schedule.num_stages, schedule.microbatches
    graph, stage_rank = schedule.graph, schedule.placement.stage_rank
    out: list[Need] = []
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
            out.append(_transfer(cost, schedule, base, s, stage, stage_rank[s], r))
    return tuple(out)


def _explicit(op: Op, r: int, index: DepIndex, cost: CostModel, schedule: Schedule,
              kinds: list[str], missing: int) -> tuple[Need, ...]:
    """Deps of one op by id: its own needs and its gang peers' (a barrier on a peer's stream
    predecessor costs no transfer)."""
    S, M = schedule.num_stages, schedule.microbatches
    stage_rank = schedule.placement.stage_rank
    out: list[Need] = []
    wants = [(op, d) for d in index.own_needs(op)] + index.gang_needs(op)
    prev = index.stream_prev
    carried = {at: _carried(at, stage_rank[at.stage] if at is not op else r, index, stage_rank)
               for at in dict.fromkeys(at for at, _d in wants)}
    for at, d in wants:
        if not index.has(d):
            out.append((missing, 0.0, None))
            continue
        ident = (kinds.index(d.kind) * S + d.stage) * M + d.mb
        to = stage_rank[at.stage] if at is not op else r
        barrier = at is not op and prev(at) == d
        need = (ident, 0.0, None) if barrier else _transfer(
            cost, schedule, ident, d.stage, at.stage, stage_rank[d.stage], to)
        hop = need[2]
        out.append((ident, need[1] + hop[2], None) if hop and d in carried[at] else need)
    return tuple(out)


def _carried(op: Op, r: int, index: DepIndex, stage_rank: tuple[int, ...]) -> set[Op]:
    """Inputs of ``op`` (on rank r) that a receive brings: a gate of op on its rank that waits
    for an op on another rank (a send) needing them. The message is the send's; op's own need
    stays a pure delay (latency + occupancy), which the receive's arrival already bounds."""
    out: set[Op] = set()
    for gate in index.own_needs(op):
        kinds = {k for g in index.registry[gate.kind].gates for k in g.kinds}
        if stage_rank[gate.stage] != r or op.kind not in kinds:
            continue
        for send in index.own_needs(gate):
            if stage_rank[send.stage] != r:
                out.update(index.own_needs(send))
    return out
