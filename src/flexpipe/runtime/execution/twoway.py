"""DualPipe (the two-way schedule, ``flexpipe.schedules.dualpipe_twoway``) on the runtime.

The model is cut into p model stages. Rank r builds model stage r (the schedule's stage r, on
the way down) and model stage p-1-r (its stage 2p-1-r, on the way up), both cut from the same
seeded model, so the two copies of every model stage (on ranks r and p-1-r) start equal: 2x
the parameters of a one-copy pipeline. A step takes 2m micro-batches: the way down trains on
0..m-1, the way up on m..2m-1 (``dualpipe_twoway.data_index``), every loss divided by 2m, as
one process averages them. After the backward the two ranks of each pair (r, p-1-r), which
hold the same two model stages, sum every gradient and the step's loss over a group of their
own, made once (``Twins``): both copies take the same update and stay equal. The average over
data-parallel replicas and the optimizer step follow; clipping counts each model parameter
once (the copy on the way down); a checkpoint, keyed by the model's parameter names, holds
each once (the twins' equal copies are written once, as replicas' are). What does not run yet
is refused by name (``check_two_way_job``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.segments import Segment, build_graph_stages, check_graph
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.transport import comm, groups
from flexpipe.runtime.transport.engines import local
from flexpipe.schedules.dualpipe_twoway import is_two_way, model_stage, two_way_graph

REFUSED = "does not run DualPipe's two-way placement yet"


def build_two_way_stages(segments: Sequence[Segment], partition: Sequence[int] | None,
                         schedule: Schedule, keep: Sequence[int]) -> dict[int, StageModule]:
    """The stage modules of DualPipe's stages ``keep`` (a rank's two): the chain model cut
    into p model stages (``partition``: layers per model stage), stage s running model stage
    ``model_stage(s, p)``."""
    p = schedule.num_ranks
    if len(segments) != 1:
        raise ConfigError(f"{schedule.name}: the runtime {REFUSED} for a model of "
                          f"{len(segments)} segments (a graph); it runs chains of layers")
    check_graph(two_way_graph(p), schedule.graph)
    wanted = {s: model_stage(s, p) for s in keep}
    if len(set(wanted.values())) != len(wanted):
        raise ConfigError(f"{schedule.name}: stages {sorted(keep)} run the same model stage "
                          "twice on one rank")
    built = build_graph_stages(segments, partition, p, sorted(wanted.values()),
                               StageGraph.chain(p))
    ties = next(iter(built.values())).ties if built else ()
    if ties:
        raise ConfigError(f"{schedule.name}: the runtime {REFUSED} with tied weights "
                          f"({ties[0].name!r} is used by several stages)")
    return {s: built[k] for s, k in wanted.items()}


class Twins:
    """The two copies of this rank's model stages: their group (this rank and rank p-1-r of
    its replica), made once, collectively; ``sum`` adds their gradients."""

    def __init__(self, schedule: Schedule, stages: Mapping[int, StageModule],
                 grid: Any) -> None:
        p = schedule.num_ranks
        slices = [(d, e, t) for d in range(grid.dp) for e in range(grid.ep)
                  for t in range(grid.tp)]
        layouts = [[grid.rank_at(dp=d, ep=e, tp=t, pp=r) for r in (a, p - 1 - a)]
                   for a in range(p // 2) for d, e, t in slices]
        made = groups.new_groups(layouts)
        me = grid.coords["pp"]
        mine = (grid.coords["dp"], grid.coords["ep"], grid.coords["tp"])
        self.group = made[min(me, p - 1 - me) * len(slices) + slices.index(mine)]
        """The group of this rank and the other holder of its two model stages."""
        self.copies = {id(q) for s, module in stages.items() if s >= p
                       for q in module.parameters()}
        """The ids of the parameters of this rank's stage on the way up (the copy clipping
        does not count: its twin on the way down does)."""
        by_model = sorted(stages, key=lambda s: model_stage(s, p))
        self.params = [q for s in by_model for q in stages[s].parameters() if q.requires_grad]
        """The trainable parameters in model-stage order: the same order on both ranks of the
        pair (rank r holds stages r and 2p-1-r, its twin 2p-1-r's model stage first)."""

        self.earlier: list[torch.Tensor | None] = []
        """What each gradient held before this step (``keep``: steps accumulated without
        zeroing), the pair's sum already."""

    def keep(self) -> None:
        """Before a step: set aside what the gradients hold (none when they were zeroed), so
        that ``sum`` adds only this step's part."""
        self.earlier = [g.clone() if g is not None and bool(g.any()) else None
                        for g in (None if q.grad is None else local(q.grad)
                                  for q in self.params)]

    def sum(self, extra: Sequence[torch.Tensor] = ()) -> None:
        """Sum this step's gradient of every parameter of this rank's two model stages (a
        missing one as zeros), and ``extra`` (the step's loss), over the pair, in place."""
        for q in self.params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        grads = [local(q.grad) for q in self.params if q.grad is not None]
        earlier = self.earlier or [None] * len(grads)
        for g, before in zip(grads, earlier, strict=True):
            if before is not None:
                g.sub_(before)
        self.add(grads + list(extra))
        for g, before in zip(grads, earlier, strict=True):
            if before is not None:
                g.add_(before)
        self.earlier = []

    def add(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum ``tensors`` (the same list on both ranks) over the pair, in place."""
        comm.all_reduce_sum(tensors, self.group)

    def counted(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the copies on the way up (each model parameter once)."""
        return [q for q in params if id(q) not in self.copies]


def twins_of(schedule: Schedule, stages: Mapping[int, StageModule], grid: Any
             ) -> Twins | None:
    """The ``Twins`` of a DualPipe rank (None for any other schedule)."""
    return Twins(schedule, stages, grid) if is_two_way(schedule) else None


def refuse_two_way(schedule: Schedule, refused: Mapping[str, bool]) -> None:
    """Raise ``ConfigError`` naming the first of ``refused`` (what -> whether asked for)."""
    found = [what for what, bad in refused.items() if bad]
    if found:
        raise ConfigError(f"{schedule.name}: the runtime {REFUSED} with {found[0]}; "
                          "dualpipev runs the same overlapped pairs on a V placement")


def check_two_way_job(job: Any, own_model: bool) -> None:
    """Refuse, by name, what the runtime does not run with DualPipe yet: tensor parallelism,
    mixed precision, models of your own (``own_model``: the ``Job``'s is one); nothing for
    other schedules (FSDP: ``handlers.check_supported``; models of several segments and tied
    weights: ``build_two_way_stages``)."""
    if not is_two_way(job.schedule):
        return
    cfg = job.train
    refuse_two_way(job.schedule, {"tensor parallelism (tp > 1)": cfg.tp > 1,
                                  "mixed precision": cfg.mixed_precision is not None,
                                  "a model of your own": own_model})


def model_graph(schedule: Schedule) -> StageGraph:
    """The stage graph the model must be cut into for ``schedule``: DualPipe's model stages, a
    chain of p (its own graph checked to be the two chains of ``two_way_graph``), else the
    schedule's graph."""
    if not is_two_way(schedule):
        return schedule.graph
    check_graph(two_way_graph(schedule.num_ranks), schedule.graph)
    return StageGraph.chain(schedule.num_ranks)
