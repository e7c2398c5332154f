"""The validator's fast path: the structural rules checked on integer arrays (numpy), in time and
memory proportional to the ops. ``sound`` answers only "nothing to report": True guarantees that
the full structural check (``flexpipe.sim.validate``) finds no violation; False means "look
closer" (the full check then names each violation). Cases it does not decide -- gangs, needs or
gates that span a run of micro-batches, ops that are not (str, int, int) -- answer False.

An op's id is ``(kind * S + stage) * M + mb``; ``present[id]`` says whether the schedule runs
it, ``rank_of``/``pos_of`` where. Rules, in the validator's words: unknown-kind, range,
placement, duplicate (ids seen twice), completeness (F, and BW or B + W but not both, for every
stage and micro-batch), missing-dependency (a non-optional need with no alternative present)
and order (a need or a gate placed later on the same rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from flexpipe.errors import ConfigError
from flexpipe.ir.kinds import KindRegistry, Need
from flexpipe.ir.schedule import Schedule

Relation = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Table:
    """Every op as columns (kind index, stage, mb, rank, position) and the id lookups."""

    kinds: list[str]
    S: int
    M: int
    kind: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    rank: np.ndarray
    pos: np.ndarray
    present: np.ndarray
    rank_of: np.ndarray
    pos_of: np.ndarray
    num_ranks: int

    def per_rank(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each rank's (kind index, stage, mb) arrays, as the simulator's compiler takes them."""
        cuts = np.flatnonzero(np.diff(self.rank)) + 1
        starts = [0, *cuts.tolist()]
        ranks = self.rank[starts].tolist()
        out = [(np.zeros(0, np.int64),) * 3 for _ in range(self.num_ranks)]
        for r, kind, stage, mb in zip(ranks, np.split(self.kind, cuts), np.split(self.stage, cuts),
                                      np.split(self.mb, cuts), strict=True):
            out[r] = (kind, stage, mb)
        return out

    def kind_id(self, name: str) -> int | None:
        """The index of kind ``name``, None when the schedule has no such op."""
        return self.kinds.index(name) if name in self.kinds else None


def sound(schedule: Schedule, registry: KindRegistry) -> Table | None:
    """The ops' table when the validator's structural rules find nothing, else None (module
    docstring: None may also mean "not decided here")."""
    kinds = sorted(schedule.kinds())
    if schedule.graph.gangs or any(k not in registry or _spans_runs(registry, k)
                                   for k in kinds):
        return None
    table = _table(schedule, kinds)
    if table is None or not _complete(table):
        return None
    graph = schedule.graph
    relations: dict[str, Relation] = {"pred": graph.preds, "succ": graph.succs}
    for k, name in enumerate(kinds):
        ops = np.flatnonzero(table.kind == k)
        if not all(_need_ok(table, ops, need, relations) for need in registry[name].needs):
            return None
        if not all(_gate_ok(table, ops, gate.kinds) for gate in registry[name].gates):
            return None
    return table


def _spans_runs(registry: KindRegistry, name: str) -> bool:
    spec = registry[name]
    return any(n.span != "one" for n in spec.needs) or any(g.span != "one" for g in spec.gates)


def _columns(schedule: Schedule, kidx: dict[str, int]) -> tuple[np.ndarray, ...] | None:
    """(kind, stage, mb, rank, position) of every op; None when an op is not (str, int, int)."""
    n = len(schedule)
    if n == 0:
        return None
    flat = list(chain.from_iterable(schedule.ranks))
    kinds, stages, mbs = zip(*flat, strict=True)
    if not all(type(x) is int for x in chain(set(stages), set(mbs))):
        return None
    lengths = np.fromiter(map(len, schedule.ranks), np.int64, schedule.num_ranks)
    rank = np.repeat(np.arange(schedule.num_ranks), lengths)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return (np.fromiter(map(kidx.__getitem__, kinds), np.int64, n),
            np.fromiter(stages, np.int64, n), np.fromiter(mbs, np.int64, n), rank,
            np.arange(n) - starts)


def _table(schedule: Schedule, kinds: list[str]) -> Table | None:
    """The ops' table; None when a range, placement or duplicate rule fails."""
    S, M = schedule.num_stages, schedule.microbatches
    cols = _columns(schedule, {k: i for i, k in enumerate(kinds)})
    if cols is None or S * M > len(schedule):  # each (stage, mb) needs an F of its own
        return None
    kind, stage, mb, rank, pos = cols
    if stage.min() < 0 or stage.max() >= S or mb.min() < 0 or mb.max() >= M:
        return None
    stage_rank = np.asarray(schedule.placement.stage_rank, dtype=np.int64)
    if np.any(stage_rank[stage] != rank):
        return None
    ids = (kind * S + stage) * M + mb
    size = len(kinds) * S * M
    counts = np.bincount(ids, minlength=size)
    if counts.max() > 1:
        return None
    rank_of = np.full(size, -1, dtype=np.int64)
    pos_of = np.full(size, -1, dtype=np.int64)
    rank_of[ids], pos_of[ids] = rank, pos
    return Table(kinds, S, M, kind, stage, mb, rank, pos, counts.astype(bool), rank_of, pos_of,
                 schedule.num_ranks)


def _plane(t: Table, name: str) -> np.ndarray:
    """Per (stage, mb): whether an op of kind ``name`` is there."""
    k = t.kind_id(name)
    if k is None:
        return np.zeros(t.S * t.M, dtype=bool)
    return t.present[k * t.S * t.M:(k + 1) * t.S * t.M]


def _complete(t: Table) -> bool:
    """F once, and BW or B + W (not both), for every stage and micro-batch."""
    f, b, w, bw = (_plane(t, k) for k in ("F", "B", "W", "BW"))
    return bool(np.all(f & ((bw & ~b & ~w) | (~bw & b & w))))


def _targets(t: Table, ops: np.ndarray, where: str,
             relations: dict[str, Relation]) -> tuple[np.ndarray, np.ndarray]:
    """(op row, stage) of each stage an op's need points at: its own, or each pred/succ."""
    if where == "same":
        return ops, t.stage[ops]
    rel = relations[where]
    degree = np.fromiter(map(len, rel), np.int64, len(rel))
    flat = np.fromiter(chain.from_iterable(rel), np.int64, int(degree.sum()))
    first = np.cumsum(degree) - degree
    deg = degree[t.stage[ops]]
    rows = np.repeat(ops, deg)
    within = np.arange(rows.size) - np.repeat(np.cumsum(deg) - deg, deg)
    return rows, flat[np.repeat(first[t.stage[ops]], deg) + within]


def _need_ok(t: Table, ops: np.ndarray, need: Need, relations: dict[str, Relation]) -> bool:
    """Every op's ``need`` is present (unless optional) and not later on the same rank."""
    rows, stages = _targets(t, ops, need.where, relations)
    chosen = np.full(rows.size, -1, dtype=np.int64)
    for name in need.kinds:
        k = t.kind_id(name)
        if k is None:
            continue
        ids = (k * t.S + stages) * t.M + t.mb[rows]
        hit = (chosen < 0) & t.present[ids]
        chosen[hit] = ids[hit]
    found = chosen >= 0
    if not need.optional and not np.all(found):
        return False
    return _in_order(t, chosen[found], rows[found])


def _gate_ok(t: Table, ops: np.ndarray, kinds: Sequence[str]) -> bool:
    """Each present op that one of ``ops`` gates comes after it on its rank."""
    for name in kinds:
        k = t.kind_id(name)
        if k is None:
            continue
        ids = (k * t.S + t.stage[ops]) * t.M + t.mb[ops]
        hit = t.present[ids]
        rows = np.flatnonzero(hit)
        targets = ids[hit]
        later = (t.rank_of[targets] == t.rank[ops[rows]]) & (t.pos_of[targets]
                                                             < t.pos[ops[rows]])
        if np.any(later):
            return False
    return True


def _in_order(t: Table, deps: np.ndarray, rows: np.ndarray) -> bool:
    """No dep sits later than the op needing it on the op's own rank."""
    return not np.any((t.rank_of[deps] == t.rank[rows]) & (t.pos_of[deps] > t.pos[rows]))


MAX_OPS = 5_000_000
MAX_IDS = 50_000_000


def guard(schedule: Schedule, kinds: Sequence[str]) -> None:
    """A ConfigError when ``schedule`` is too big to check or simulate in memory: more than
    ``MAX_OPS`` ops, or more than ``MAX_IDS`` possible op ids (kinds x stages x micro-batches,
    what the simulator keeps one slot for)."""
    n = sum(map(len, schedule.ranks))
    ids = len(kinds) * schedule.num_stages * schedule.microbatches
    if n > MAX_OPS:
        raise ConfigError(f"schedule has {n:,} ops; at most {MAX_OPS:,} can be validated or "
                          f"simulated (split the run into shorter schedules)")
    if ids > MAX_IDS:
        raise ConfigError(f"schedule has {len(kinds)} op kinds x {schedule.num_stages} stages x "
                          f"{schedule.microbatches} micro-batches = {ids:,} possible ops; at most "
                          f"{MAX_IDS:,} can be validated or simulated")


def transport_implied(schedule: Schedule, comm_kinds: Sequence[str]) -> bool:
    """Whether the pair-order rule holds for the lowering of ``schedule`` once its structure is
    sound and it has no cycle of waits: a schedule without communication ops on a graph whose
    stages have at most one producer and one consumer, without gangs.

    Why: lowering puts each send right after the op that makes its data and each receive before
    the op it gates, one message per receive op, and no send moves; by the time a rank reaches
    the op that consumes a message, it has posted that message's receive and every earlier one
    of its channel in the sender's order (the transport's rule). So a message has arrived
    exactly when its sender has passed the producing op, each op waits in the transport's replay
    for exactly what it waits for in the simulator, and the replay ends exactly when the
    simulation does. ``tests/test_validate_fast.py`` checks the two paths agree."""
    graph = schedule.graph
    return (not graph.gangs and not schedule.kinds() & set(comm_kinds)
            and all(len(x) <= 1 for x in graph.preds) and all(len(x) <= 1 for x in graph.succs))
