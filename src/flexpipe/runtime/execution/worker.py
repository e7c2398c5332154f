"""One pipeline rank, set up once for every way of training: the CLI's training loop
(``flexpipe.runtime.processes.train``) and the public ``Pipeline``
(``flexpipe.runtime.pipeline.api``) both build a ``RankWorker``.

A ``RankWorker`` moves this rank's stages to its device, joins the data-parallel group of its
pipeline rank, shards the stages' parameters when the schedule gathers them (AG/RS), builds an
``Executor`` over point-to-point links to the other ranks of its replica, and averages the
gradients over the replicas after a step.

A weight used by stages on several ranks (tied weights: ``Tie``) is one logical parameter,
as Megatron-LM keeps its embedding group: every rank holding a use starts from the same value
(every rank builds the same model), and after each step the gradient of its copies is summed
over those ranks (a process group per tie and replica), so every copy takes the same update.

Rank layout: global rank = replica x pipeline ranks + pipeline rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution import fsdp
from flexpipe.runtime.execution.executor import Executor, Handler
from flexpipe.runtime.execution.stage import LossFn, StageModule, Tie
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.p2p import P2P


def layout(pp: int, world: int, rank: int) -> tuple[int, int, int]:
    """(replicas, pipeline rank, replica) of global ``rank`` with ``pp`` pipeline ranks."""
    if pp < 1 or world % pp:
        raise ConfigError(f"world size {world} is not a multiple of the schedule's {pp} "
                          "pipeline ranks")
    return world // pp, rank % pp, rank // pp


def dp_group(pp: int, dp: int, pipe_rank: int) -> object:
    """This pipeline rank's data-parallel group (every rank creates all of them, together);
    None with one replica."""
    if dp == 1:
        return None
    return comm.new_groups([[d * pp + r for d in range(dp)] for r in range(pp)])[pipe_rank]


class RankWorker:
    """This rank's stages on its device, its data-parallel group, FSDP shards and executor."""

    def __init__(self, schedule: Schedule, rank: int, world: int,
                 stages: Mapping[int, StageModule], loss_fn: LossFn, *,
                 handlers: Mapping[str, Handler], timeout_s: float, lookahead: int = 2,
                 seed: int | None = None, measure_memory: bool = False) -> None:
        pp = schedule.num_ranks
        self.dp, self.pipe_rank, self.replica = layout(pp, world, rank)
        self.rank, self.world, self.timeout_s, self.lookahead = rank, world, timeout_s, lookahead
        self.seed, self.loss_fn = seed, loss_fn
        self.device = comm.device()
        self.stages = {s: m.to(self.device) for s, m in stages.items()}
        self.group = dp_group(pp, self.dp, self.pipe_rank)
        self.peers = [self.replica * pp + r for r in range(pp)]
        self.shards = fsdp.shard_stages(self.stages, self.group, self.dp, self.replica) \
            if fsdp.uses_fsdp(schedule.ranks[self.pipe_rank]) else {}
        if self.shards and _ties(self.stages):
            raise ConfigError("tied weights with FSDP (AG/RS) schedules are not supported: "
                              f"{_ties(self.stages)[0].name!r} is used by several stages")
        self.tied = _tie_groups(schedule, self.stages, pp, self.dp, self.replica)
        optimized, reduced = fsdp.trainable(self.stages, self.shards)
        self.optimized, self.reduced = _unique(optimized), _unique(reduced)
        self.executor = self.executor_for(schedule, handlers, measure_memory)

    def executor_for(self, schedule: Schedule, handlers: Mapping[str, Handler],
                     measure_memory: bool = False) -> Executor:
        """An executor of ``schedule`` (this worker's, or another over the same stages, e.g.
        forward only) with its own point-to-point links."""
        return Executor(schedule, self.pipe_rank, self.stages, self.loss_fn,
                        P2P(self.peers, self.timeout_s, self.device), handlers,
                        device=self.device, lookahead=self.lookahead, shards=self.shards,
                        seed=self.seed, replica=self.replica, measure_memory=measure_memory)

    def reduce_gradients(self, extra: Sequence[torch.Tensor] = ()) -> None:
        """Average the gradients of what the replicas hold in full (and ``extra`` tensors, such
        as the step's loss) over the data-parallel group."""
        for param, group in self.tied:
            if param.grad is not None:
                comm.all_reduce_sum([param.grad], group)
        grads = [p.grad for p in self.reduced if p.grad is not None]
        comm.all_reduce_mean([*grads, *extra], self.group, self.dp)

    def named(self, grads: bool) -> dict[str, torch.Tensor]:
        """Every parameter (``grads``: its gradient) of this rank by global name, on the CPU,
        full tensors also where FSDP shards them."""
        return named_tensors(self.stages, grads) | fsdp.full_named(self.shards, grads)


def _ties(stages: Mapping[int, StageModule]) -> tuple[Tie, ...]:
    """The model's tied parameters (every stage carries the same list)."""
    return next(iter(stages.values())).ties if stages else ()


def _tie_groups(schedule: Schedule, stages: Mapping[int, StageModule], pp: int, dp: int,
                replica: int) -> list[tuple[torch.Tensor, object]]:
    """(this rank's copy of a tied parameter, the group of the ranks holding its uses) for
    every tie that spans ranks; the groups are created collectively (same order everywhere)."""
    spanning = []
    for tie in _ties(stages):
        ranks = sorted({schedule.placement.stage_rank[s] for s in tie.stages})
        if len(ranks) > 1:
            spanning.append((tie, ranks))
    groups = comm.new_groups([[d * pp + r for r in ranks] for _, ranks in spanning
                              for d in range(dp)])
    out: list[tuple[torch.Tensor, object]] = []
    for k, (tie, _) in enumerate(spanning):
        mine = [(s, local) for s, local in tie.uses if s in stages]
        if mine:
            s, local = mine[0]
            out.append((stages[s].get_parameter(local), groups[k * dp + replica]))
    return out


def _unique(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without repeats (a tied parameter used by two stages of this rank)."""
    return list({id(p): p for p in params}.values())


def named_tensors(stages: Mapping[int, StageModule], grads: bool) -> dict[str, torch.Tensor]:
    """The stages' parameters (``grads``: their gradients, zeros where none) by global name,
    detached copies on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        for name, p in stage.named_global_parameters().items():
            t = p.grad if grads else p
            out[name] = (torch.zeros_like(p) if t is None else t).detach().cpu().clone()
    return out
