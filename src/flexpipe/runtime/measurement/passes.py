"""A cost model from a pipeline's own measured steps: per stage the mean time of each kind of
pass (F, B, W, BW) as the executor timed it (the mean, not the median: a step lasts the sum of
the passes on its critical path, and on a shared host their times skew to the right), and the
part of it spent inside the experts' all-to-alls (``transport.exchange``: ``F_COMM``,
``B_COMM``, ``BW_COMM``, ``W_COMM``, the keys an overlapped pair hides,
``flexpipe.ir.overlap``), every rank's measured on that rank and the
ranks holding a stage (its ``ep`` ranks and data replicas) averaged. This is how an
expert-parallel model is profiled: its passes exchange tokens with the other ``ep`` ranks, so
they are timed where they run, in training steps, not stage by stage alone
(``measurement.profile``): ``step_cost`` inside a launch (collective), ``last_step_cost``
after one from the ranks' results (``flexpipe run --predict --ep``).
``flexpipe.cost.io.save_cost`` writes the result as a cost file."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.errors import ConfigError
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.lower import lower
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import BACKWARDS, COMM_SHARE, HIDE_SHARE, pair_time
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.executor import StepResult
from flexpipe.runtime.transport import comm

PASSES = ("F", "B", "W", "BW")
"""The kinds of pass whose times a cost model takes."""

Row = dict[str, float]


def rank_passes(ops: Sequence[Op], steps: Sequence[StepResult]) -> dict[int, Row]:
    """This rank's stages: per kind of pass, the mean seconds over ``steps`` (results of
    this rank's executor running ``ops``) and the mean seconds inside the all-to-alls
    (``{kind}_COMM``; 0 for a stage without experts)."""
    if not steps:
        raise ConfigError("a cost model from measured steps needs at least one step")
    out: dict[int, Row] = {}
    for s in sorted({op.stage for op in ops if op.kind in PASSES}):
        row: Row = {}
        for kind in PASSES:
            at = [i for i, op in enumerate(ops) if op.kind == kind and op.stage == s]
            if not at:
                continue
            row[kind] = statistics.mean(r.ends[i] - r.starts[i] for r in steps for i in at)
            comm = statistics.mean(r.comm[i] if r.comm else 0.0 for r in steps for i in at)
            row[COMM_SHARE.format(kind)] = min(comm, row[kind])
        out[s] = row
    return out


def merged(every: Sequence[Mapping[int, Row]]) -> dict[int, Row]:
    """Every rank's ``rank_passes`` as one table: a stage's key averaged over the ranks that
    have it."""
    stages = sorted({s for part in every for s in part})
    table: dict[int, Row] = {}
    for s in stages:
        rows = [part[s] for part in every if s in part]
        keys = dict.fromkeys(k for row in rows for k in row)
        table[s] = {k: statistics.mean(row[k] for row in rows if k in row) for k in keys}
    return table


def pair_hide(ops: Sequence[Op], heads: Iterable[int], steps: Sequence[StepResult],
              rows: Mapping[int, Row]) -> dict[int, Row]:
    """Per stage of a pair's backward, the median share of what its pairs could hide that
    they did hide (``HIDE_SHARE``) in ``steps`` run with the pairs' passes at once (the
    executor's pairs starting at positions ``heads``), against the passes alone (``rows``,
    ``rank_passes`` of the same order run in turn); within [0, 1] (a cost's times are not
    negative: a pair slower than its passes in turn counts as hiding nothing)."""
    shares: dict[int, list[float]] = {}
    for i in heads:
        a, b = ops[i], ops[i + 1]
        parts = [(rows[op.stage][op.kind], rows[op.stage].get(COMM_SHARE.format(op.kind), 0.0))
                 for op in (a, b)]
        alone = parts[0][0] + parts[1][0]
        saving = alone - pair_time(parts[0], parts[1])
        if saving <= 0:
            continue
        back = (a if a.kind in BACKWARDS else b).stage
        for r in steps:
            slot = max(r.ends[i], r.ends[i + 1]) - min(r.starts[i], r.starts[i + 1])
            shares.setdefault(back, []).append((alone - slot) / saving)
    return {s: {HIDE_SHARE: max(0.0, min(1.0, statistics.median(v)))}
            for s, v in shares.items()}


def filled(row: Row) -> Row:
    """``row`` with B and W where its stage ran its backwards fused only (BW, as under 1F1B):
    B (and ``B_COMM``) its BW's and W 0, so that a schedule of fused backwards reads the
    measured BW; a split schedule predicted from it would take W as free."""
    if "BW" not in row or ("B" in row and "W" in row):
        return row
    out = {"B": row["BW"], "W": 0.0, **row}
    out.setdefault(COMM_SHARE.format("B"), row.get(COMM_SHARE.format("BW"), 0.0))
    return out


def post(ops: Sequence[Op], steps: Sequence[StepResult]) -> float:
    """The median seconds of a send (``SEND_F``, ``SEND_B``: the ops on the ``send`` stream)
    on the compute thread (``Comm.post``; 0 without sends)."""
    spans = [r.ends[i] - r.starts[i] for r in steps for i, op in enumerate(ops)
             if KINDS[op.kind].stream == "send"]
    return statistics.median(spans) if spans else 0.0


def step_cost(ops: Sequence[Op], steps: Sequence[StepResult], num_ranks: int,
              overlapped: tuple[Iterable[int], Sequence[StepResult]] | None = None
              ) -> CostModel:
    """Collective over the default group: the cost model (seconds) of every stage from each
    rank's measured ``steps`` of its ``ops`` (run one pass at a time), the links' ``post``
    from their sends; ``overlapped``: (the pairs' first positions, steps of the same order
    with the pairs' passes at once), which give the stages' ``HIDE_SHARE``."""
    mine = rank_passes(ops, steps)
    if overlapped is not None:
        for s, row in pair_hide(ops, overlapped[0], overlapped[1], mine).items():
            mine[s].update(row)
    parts = [part for part in comm.all_gather_object((mine, post(ops, steps)))
             if part is not None]
    return cost_of(parts, num_ranks)


def cost_of(parts: Sequence[tuple[Mapping[int, Row], float]], num_ranks: int,
            unit: float = 1.0) -> CostModel:
    """The cost model of every rank's (``rank_passes``, ``post``), times in ``unit`` per
    second: a stage's keys averaged over the ranks that have it (``merged``, ``filled``)."""
    table = merged([rows for rows, _ in parts])
    stages = tuple(StageCost(filled(table[s])).map_times(lambda v: v * unit)
                   for s in sorted(table))
    sends = statistics.mean(p for _, p in parts)
    return CostModel(stages, Comm.uniform(num_ranks, post=sends * unit))


def check_apart(schedule: Schedule) -> None:
    """Refuse a schedule whose overlapped pairs run their passes at once (each pair is timed
    as one slot, not its passes apart)."""
    if schedule.overlaps:
        raise ConfigError(f"{schedule.name}'s overlapped pairs run their passes at once, timed "
                          "as one slot: a cost model of its passes from its run's steps needs "
                          "them in turn (benchmarks/dualpipe_overlap.py measures both ways)")


def last_step_cost(schedule: Schedule, ranks: Sequence[Any], unit: float = 1e3) -> CostModel:
    """The cost model (``unit`` per second, default ms) of a run's last step from every rank's
    result (a ``RankResult``: its ``pipe_rank`` and the step's ``starts``, ``ends`` and
    ``comm`` per op of the lowered schedule), not collective: how ``flexpipe run --predict``
    costs an expert-parallel model, whose passes exchange tokens with the other ``ep`` ranks
    and so are timed where they run. A schedule whose overlapped pairs ran at once is refused
    (``check_apart``)."""
    check_apart(schedule)
    lowered = lower(schedule)
    parts = []
    for r in ranks:
        ops = lowered.ranks[r.pipe_rank]
        step = [StepResult(None, r.starts, r.ends, comm=r.comm)]
        parts.append((rank_passes(ops, step), post(ops, step)))
    return cost_of(parts, schedule.num_ranks, unit)
