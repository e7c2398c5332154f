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

The ranks form one DeviceMesh ``dp x ep x pp x tp`` (``flexpipe.runtime.transport.mesh``), or
the user's own mesh. With ``ep > 1`` each MoE layer's experts are shared out over the
expert-parallel ranks (``transport.experts``), which train on data of their own: the data
replicas are dp x ep, an expert's gradient is summed over ``dp`` and divided by dp x ep.
Under a mixed-precision policy the experts keep float32 masters like every parameter and their
reduction over ``dp`` runs in the policy's reduce dtype; with AG/RS in the schedule FSDP2 shards
the replicated weights over the ``dp x ep`` ranks (with ``dp_replicate`` > 1 HSDP's 2-D
mesh: ``dp_replicate`` groups, each of its ``dp / dp_replicate x ep`` ranks) and leaves the
experts whole (its ``ignored_params``). With ``tp > 1`` the experts stay whole on every ``tp``
rank, their ``ep`` groups one per ``(dp, pp, tp)`` coordinate, and the tensor-parallel plan
may split no module of theirs (``Parallel.apply_tp``); expert parallelism with tensor
parallelism and HSDP together is refused
(``experts.check_layout``).
With ``tp > 1`` the stages' planned modules are split over the tensor-parallel ranks
with torch's DTensor (``engines.tensor_parallel``); with AG/RS in the schedule each stage is
sharded by torch's FSDP2 over the ``dp`` mesh (``fsdp``), or with ``dp_replicate`` > 1 over
HSDP's ``(dp_replicate, dp_shard)`` form of it. Under a mixed-precision policy
every pass computes on bfloat16 copies of float32 masters (``precision``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution import failure, fsdp
from flexpipe.runtime.execution.executor import Executor, Handler, StepResult
from flexpipe.runtime.execution.parallel import Parallel
from flexpipe.runtime.execution.precision import (
    Casting,
    MixedPrecision,
    check_masters,
    reduce_mean,
)
from flexpipe.runtime.execution.reducer import Reducer
from flexpipe.runtime.execution.stage import Batch, LossFn, StageModule, Tie
from flexpipe.runtime.execution.twoway import twins_of
from flexpipe.runtime.transport import comm, groups
from flexpipe.runtime.transport import mesh as grids
from flexpipe.runtime.transport.engines import local
from flexpipe.runtime.transport.p2p import P2P

T = TypeVar("T")
PARTIAL = ("The gradients hold part of this step's micro-batches: zero them before the next "
           "step.")
RESET = ("Every rank stopped this call and its transfers were reset: the pipeline can run "
         "the next one.")
BROKEN = ("The pipeline cannot run again: the FSDP or tensor-parallel collectives of this "
          "call were left unmatched; restart the processes and resume from your last "
          "checkpoint.")


class RankWorker:
    """This rank's stages on its device, its place in the mesh, FSDP shards and executor."""

    def __init__(self, schedule: Schedule, rank: int, world: int,
                 stages: Mapping[int, StageModule], loss_fn: LossFn, *,
                 handlers: Mapping[str, Handler], timeout_s: float, lookahead: int = 2,
                 seed: int | None = None, measure_memory: bool = False,
                 parallel: Parallel | None = None,
                 mixed_precision: MixedPrecision | None = None) -> None:
        pp, parallel = schedule.num_ranks, parallel or Parallel()
        self.mixed_precision = mixed_precision
        """The mixed-precision policy (None: every pass in the parameters' own dtype)."""
        if mixed_precision is not None:
            check_masters(stages, f"rank {rank}")
        self.rank, self.world, self.timeout_s, self.lookahead = rank, world, timeout_s, lookahead
        self.seed, self.loss_fn = seed, loss_fn
        self.device = comm.device()
        self.grid = parallel.grid(pp, world, self.device)
        self.tp, self.ep = self.grid.tp, self.grid.ep
        self.dp = self.grid.dp * self.ep
        """Data replicas: the ``dp`` replicas times the ``ep`` expert-parallel ranks (each
        trains on data of its own)."""
        self.pipe_rank = self.grid.coords["pp"]
        self.replica = self.grid.coords["dp"] * self.ep + self.grid.coords["ep"]
        """This rank's data replica (``0 .. dp - 1``)."""
        self.stages = {s: m.to(self.device) for s, m in stages.items()}
        self.tensor_parallel = parallel.apply_tp(self.stages, self.grid)
        """The model names of the modules split over the ``tp`` ranks."""
        self.overlap_pairs = parallel.overlap_pairs
        self.ep_groups = parallel.ep_groups(self.grid)
        """The experts' all-to-all groups over ``ep``, one per lane (``transport.experts``)."""
        self.experts = parallel.apply_ep(self.stages, self.grid, self.ep_groups)
        """The experts modules shared out over the ``ep`` ranks (``transport.experts``)."""
        self.group = self.grid.group("dp") if self.ep == 1 else \
            self.grid.group_over(("dp", "ep"))
        """The data replicas' group: what every replica holds in full is averaged over it."""
        self.peers = [self.grid.rank_at(pp=r) for r in range(pp)]
        self.fsdp_mesh = self.grid.fsdp_mesh(parallel.dp_replicate)  # every rank: groups
        """The mesh FSDP2 shards over: ``dp`` (``dp x ep``), or HSDP's ``(dp_replicate,
        dp_shard)``."""
        self.shards = fsdp.shard_stages(
            self.stages, self.fsdp_mesh,
            None if mixed_precision is None else mixed_precision.fsdp_policy(),
            [p for shard in self.experts for p in shard.params]) \
            if fsdp.uses_fsdp(schedule.ranks[self.pipe_rank]) else {}
        if self.shards and _ties(self.stages):
            raise ConfigError("tied weights with FSDP (AG/RS) schedules are not supported: "
                              f"{_ties(self.stages)[0].name!r} is used by several stages")
        self.tied = _tie_groups(schedule, self.stages, self.grid)
        self.twins = twins_of(schedule, self.stages, self.grid)
        """DualPipe's pair of ranks holding the same two model stages, whose gradients are
        summed after the step (``execution.twoway``; None for other schedules)."""
        self.earlier: list[torch.Tensor | None] = []
        """What each tied weight's gradient held before this step (``run``)."""
        self.clip_experts_group: Any = None
        """The pipeline and expert-parallel ranks' group, made on the first clip that needs it
        (``clipping``)."""
        if mixed_precision is not None and self.tensor_parallel:
            raise ConfigError("mixed precision with tensor parallelism is not supported yet: "
                              "run tp = 1, or FSDP (AG/RS) schedules")
        self.casting = None if mixed_precision is None else Casting(
            mixed_precision, self.stages, self.shards, schedule.graph.sinks())
        """The compute copies and float32 accumulation (``precision``; None without a
        policy)."""
        optimized, reduced = fsdp.trainable(self.stages, self.shards)
        self.optimized, self.reduced = _unique(optimized), _unique(reduced)
        self.executor = self.executor_for(schedule, handlers, measure_memory)
        self.said: dict[int, Any] = {}
        """Every rank's loss complaint in the last step (``attempt``)."""
        self.reducer = self._reducer(parallel.overlap_reduce)
        """Averages each stage's gradients as soon as they are final in the step (None:
        after the step, ``reduce_gradients``; also under a mixed-precision policy)."""

    def _reducer(self, wanted: bool) -> Reducer | None:
        """The overlapped reduction of the replicated gradients (tied weights apart: their
        sum over the tie's ranks comes first, after the step; and sharded experts, averaged
        their own way after it)."""
        if not wanted or self.dp == 1 or self.mixed_precision is not None:
            return None
        apart = {id(p) for p, _ in self.tied} | self._expert_ids()
        reducer = Reducer.of(self.executor.ops, self.stages,
                             [p for p in self.reduced if id(p) not in apart], self.group, self.dp)
        self.executor.on_done = reducer.ready
        return reducer

    def executor_for(self, schedule: Schedule, handlers: Mapping[str, Handler],
                     measure_memory: bool = False) -> Executor:
        """An executor of ``schedule`` (this worker's, or another over the same stages, e.g.
        forward only) with its own point-to-point links."""
        if self.casting is not None:
            handlers = self.casting.wrap(handlers)
        ex = Executor(schedule, self.pipe_rank, self.stages, self.loss_fn,
                      P2P(self.peers, self.timeout_s, self.device), handlers,
                      device=self.device, lookahead=self.lookahead, shards=self.shards,
                      seed=self.seed, replica=self.replica, measure_memory=measure_memory,
                      concurrent_pairs=self.tp == 1 and self.overlap_pairs)
        if self.casting is not None and ex.memory_meter is not None:
            ex.memory_meter.exclude(self.casting.copies.values())  # weights, not activations
        return ex

    def run(self, batch: Batch, metered: bool = True,
            weights: Sequence[float] | None = None, call: str = "the step") -> StepResult:
        """One step of the executor on ``batch`` (``weights``: each micro-batch's loss weight,
        ``Executor.step``), ``attempt``ed: a failure on any rank raises one ``RankError`` on
        every rank. What a tied weight's gradient already held (steps accumulated without
        zeroing) is kept aside first: that part is a sum over the tie's ranks already, and
        ``reduce_gradients`` sums only this step's."""
        grads = [None if p.grad is None else local(p.grad) for p, _ in self.tied]
        self.earlier = [g.clone() if g is not None and bool(g.any()) else None for g in grads]
        if self.reducer is not None:
            self.reducer.reset()
        if self.twins is not None:
            self.twins.keep()
        out = self.attempt(self.executor, lambda: self.executor.step(batch, metered, weights),
                           call, PARTIAL)
        refused = self.said  # every rank: one decision
        if refused:
            raise ConfigError("the step's loss was refused on every rank: " + "; ".join(
                f"rank {r}: {text}" for r, text in sorted(refused.items())))
        return out

    def attempt(self, executor: Executor, part: Callable[[], T], call: str,
                after: str = "") -> T:
        """This rank's ``part`` of ``call`` (a step of ``executor``), then one agreement of
        every rank (``flexpipe.runtime.execution.failure``): a rank that fails abandons its
        transfers at once, so that its peers stop waiting; if any rank failed, every rank
        replaces the executor's links and raises the same ``RankError`` naming where it began
        (``after``: what the caller should do next, e.g. zero the gradients). Otherwise
        ``part``'s result, with every rank's loss complaint in ``said`` (rank -> text)."""
        mine: failure.Failure | str | None = None
        raised: Exception | None = None
        try:
            with self.computing():
                out, mine = part(), executor.loss_error
        except Exception as exc:
            executor.p2p.abandon()  # peers waiting on this rank stop now
            for group in self.collective_groups(executor):
                groups.break_group(group)  # and replicas / tp peers blocked in a collective
            mine, raised = failure.of(exc, self.rank, executor.current), exc
        try:
            said = comm.complaints(mine)
        except comm.PeerError:
            if raised is not None:
                raise raised from None  # a rank is gone: this rank's own failure names it
            raise
        failed = {r: f for r, f in said.items() if isinstance(f, failure.Failure)}
        if failed:
            recovered = self.relink(executor)
            raise failure.error(call, failed, recovered, (after + " " if after else "") + (
                RESET if recovered else BROKEN)) from raised
        self.said = said
        return out

    def collective_groups(self, executor: Executor) -> list[object]:
        """The groups whose collectives a peer may be blocked in during ``executor``'s step
        (FSDP's gathers and reduce-scatters, the overlapped reduction over ``dp``, HSDP's
        replicate and shard groups, or the ``dp x ep`` group FSDP2 shards over under expert
        parallelism; the tensor-parallel all-reduces over ``tp``; the experts'
        all-to-alls over ``ep``): a failing rank breaks them too, so those peers stop at once
        (the pipeline cannot run again afterwards: ``relink``)."""
        held: list[object] = []
        if executor is self.executor and (self.shards or self.reducer is not None):
            held.append(self.group)
        if executor is self.executor and self.shards and self.fsdp_mesh is not None \
                and (self.fsdp_mesh.ndim == 2 or self.ep > 1):  # HSDP's groups, or dp x ep
            held += self.fsdp_mesh.get_all_groups()
        if self.tp > 1:
            held.append(self.grid.group("tp"))
        if self.experts:
            held += self.ep_groups
        return held

    def relink(self, executor: Executor) -> bool:
        """New transfer links for ``executor`` after a call abandoned part-way (every rank at
        the same point); whether the pipeline can run again: not when the step gathers FSDP
        shards or splits layers over tensor-parallel ranks, whose collectives were left
        unmatched, nor when gradients average over the replicas during the step (another
        replica's buckets may be left in flight: ``reducer``)."""
        executor.p2p.close()
        executor.relink(P2P(self.peers, self.timeout_s, self.device))
        if self.reducer is not None and executor is self.executor:  # buckets may fly
            self.reducer.flying = []
            return False
        return not self.shards and self.tp == 1 and not self.experts

    def computing(self) -> contextlib.AbstractContextManager[None]:
        """Where a step runs: on the compute copies under a mixed-precision policy."""
        return contextlib.nullcontext() if self.casting is None else self.casting.computing()

    def reduce_gradients(self, extra: Sequence[torch.Tensor] = ()) -> None:
        """Sum the gradient of every tied weight's copies over the tie's ranks (this step's
        part: ``run``), then average the gradients of what the replicas hold in full (and
        ``extra`` tensors, such as the step's loss) over the data-parallel group (a
        tensor-parallel shard: its local part, over the replicas of that shard). Under DualPipe
        the two copies of every model stage, and ``extra``, are summed over the pair of ranks
        holding them first (``twoway.Twins``)."""
        earlier = self.earlier or [None] * len(self.tied)
        for (param, group), before in zip(self.tied, earlier, strict=True):
            if param.grad is not None:
                grad = local(param.grad)
                if before is not None:
                    grad.sub_(before)
                comm.all_reduce_sum([grad], group)
                if before is not None:
                    grad.add_(before)
        self.earlier = []
        done: frozenset[int] = frozenset()
        if self.reducer is not None:
            self.reducer.finish()
            done = self.reducer.covered
        if self.twins is not None:  # the two copies of each model stage (DualPipe), and loss
            self.twins.sum(extra)
        owned = self._expert_ids()
        apart = owned | done
        grads = [local(p.grad) for p in self.reduced if p.grad is not None and id(p) not in apart]
        self._reduce_experts([p.grad for p in self.reduced
                              if p.grad is not None and id(p) in owned])
        if self.mixed_precision is None:
            comm.all_reduce_mean([*grads, *extra], self.group, self.dp)
            return
        reduce_mean(grads, self.group, self.dp, self.mixed_precision.reduce_dtype)
        comm.all_reduce_mean(list(extra), self.group, self.dp)

    def _expert_ids(self) -> set[int]:
        """The ids of the sharded experts' parameters (averaged their own way)."""
        return {id(p) for shard in self.experts for p in shard.params}

    def _reduce_experts(self, grads: Sequence[torch.Tensor]) -> None:
        """An expert's gradient holds every ``ep`` rank's tokens routed to it (the all-to-all's
        backward brought them), each loss a mean over its own replica's batch: summed over the
        ``dp`` replicas and divided by all ``dp x ep`` data replicas, it is one device's on the
        whole batch: the ``dp`` replicas' mean (in the policy's reduce dtype under mixed
        precision, as the replicated gradients), divided by ``ep``."""
        if not grads:
            return
        reduce_mean(grads, self.grid.group("dp"), self.grid.dp,
                    None if self.mixed_precision is None else self.mixed_precision.reduce_dtype)
        for g in grads:
            g.div_(self.ep)

    def static_bytes(self, optimizer: torch.optim.Optimizer) -> float:
        """Bytes this rank holds in parameters (the float32 masters under mixed precision),
        their gradients, ``optimizer``'s state and the compute copies, each storage once
        (``fsdp.held_bytes``): after a step, what ``memory_check.memory_cost`` predicts as
        its stages' static memory."""
        tensors = fsdp.param_tensors(self.stages, self.shards)
        tensors += [t for state in optimizer.state.values() for t in state.values()
                    if isinstance(t, torch.Tensor)]
        if self.casting is not None:
            tensors += list(self.casting.copies.values())
        return fsdp.held_bytes(tensors)

    def named(self, grads: bool) -> dict[str, torch.Tensor]:
        """Every parameter (``grads``: its gradient) of this rank by global name, on the CPU,
        full tensors also where FSDP or tensor parallelism shards them (every rank of the
        mesh calls this together)."""
        return fsdp.full_named(self.stages, grads)


def _ties(stages: Mapping[int, StageModule]) -> tuple[Tie, ...]:
    """The model's tied parameters (every stage carries the same list)."""
    return next(iter(stages.values())).ties if stages else ()


def _tie_groups(schedule: Schedule, stages: Mapping[int, StageModule],
                grid: grids.Grid) -> list[tuple[torch.Tensor, object]]:
    """(this rank's copy of a tied parameter, the group of the ranks holding its uses) for
    every tie that spans ranks, per replica and tensor-parallel rank; the groups are created
    collectively (same order everywhere)."""
    spanning = []
    for tie in _ties(stages):
        ranks = sorted({schedule.placement.stage_rank[s] for s in tie.stages})
        if len(ranks) > 1:
            spanning.append((tie, ranks))
    slices = [(d, e, t) for d in range(grid.dp) for e in range(grid.ep) for t in range(grid.tp)]
    made = groups.new_groups([[grid.rank_at(dp=d, ep=e, tp=t, pp=r) for r in ranks]
                            for _, ranks in spanning for d, e, t in slices])
    mine_slice = slices.index((grid.coords["dp"], grid.coords["ep"], grid.coords["tp"]))
    out: list[tuple[torch.Tensor, object]] = []
    for k, (tie, _) in enumerate(spanning):
        mine = [(s, local_name) for s, local_name in tie.uses if s in stages]
        if mine:
            s, local_name = mine[0]
            out.append((stages[s].get_parameter(local_name),
                        made[k * len(slices) + mine_slice]))
    return out


def _unique(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without repeats (a tied parameter used by two stages of this rank)."""
    return list({id(p): p for p in params}.values())
