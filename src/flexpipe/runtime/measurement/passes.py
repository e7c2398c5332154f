"""A cost model from a pipeline's own measured steps: per stage the median time of each kind of
pass (F, B, W, BW) as the executor timed it, and the part of it spent inside the experts'
all-to-alls (``transport.exchange``: ``F_COMM``, ``B_COMM``, ``BW_COMM``, ``W_COMM``, the keys
an overlapped pair hides, ``flexpipe.ir.overlap``), every rank's measured on that rank and the
ranks holding a stage (its ``ep`` ranks and data replicas) averaged. This is how an
expert-parallel model is profiled: its passes exchange tokens with the other ``ep`` ranks, so
they are timed where they run, in training steps, not stage by stage alone
(``measurement.profile``). ``flexpipe.cost.io.save_cost`` writes the result as a cost file."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import COMM_SHARE
from flexpipe.runtime.execution.executor import StepResult

PASSES = ("F", "B", "W", "BW")
"""The kinds of pass whose times a cost model takes."""

Row = dict[str, float]


def rank_passes(ops: Sequence[Op], steps: Sequence[StepResult]) -> dict[int, Row]:
    """This rank's stages: per kind of pass, the median seconds over ``steps`` (results of
    this rank's executor running ``ops``) and the median seconds inside the all-to-alls
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
            row[kind] = statistics.median(r.ends[i] - r.starts[i] for r in steps for i in at)
            comm = statistics.median(r.comm[i] if r.comm else 0.0 for r in steps for i in at)
            row[COMM_SHARE.format(kind)] = min(comm, row[kind])
        out[s] = row
    return out


def merged(every: Sequence[Mapping[int, Row]]) -> dict[int, Row]:
    """Every rank's ``rank_passes`` as one table: a stage's key averaged over the ranks that
    measured it."""
    stages = sorted({s for part in every for s in part})
    table: dict[int, Row] = {}
    for s in stages:
        rows = [part[s] for part in every if s in part]
        keys = dict.fromkeys(k for row in rows for k in row)
        table[s] = {k: statistics.mean(row.get(k, 0.0) for row in rows) for k in keys}
    return table


def step_cost(ops: Sequence[Op], steps: Sequence[StepResult], num_ranks: int,
              comm: Comm | None = None) -> CostModel:
    """Collective over the default group: the cost model (seconds) of every stage from each
    rank's measured ``steps`` of its ``ops``; ``comm`` the links (default: free ones between
    ``num_ranks`` pipeline ranks)."""
    every: list[dict[int, Row] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, rank_passes(ops, steps))
    table = merged([part for part in every if part is not None])
    stages = tuple(StageCost(table[s]) for s in sorted(table))
    return CostModel(stages, comm if comm is not None else Comm.uniform(num_ranks))
