"""How a pipeline rank is spread further (``Parallel``): its data-parallel replicas, tensor-
and expert-parallel ranks, HSDP's replica groups, the user's own DeviceMesh and the plans that
say which modules tensor parallelism splits (torch's DTensor, ``engines.tensor_parallel``) and
which experts expert parallelism shares out (``transport.experts``); whether gradients reduce
behind the compute and overlapped pairs run at once. A ``RankWorker`` builds its grid, groups
and split stages from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport import mesh as grids
from flexpipe.runtime.transport.engines import module_names, tensor_parallel
from flexpipe.runtime.transport.experts import (
    Shard,
    check_layout,
    expert_parallel,
    holder,
    module_paths,
)


@dataclass(frozen=True)
class Parallel:
    """How a pipeline rank is spread further: ``dp`` replicas and ``tp`` tensor-parallel ranks
    (None: from ``mesh``, else 1), the user's own DeviceMesh (None: FlexPipe builds
    ``dp x pp x tp``), and the tensor-parallel ``plan`` (module-name pattern -> ``colwise``
    or ``rowwise``; ``flexpipe.runtime.transport.engines``)."""

    dp: int | None = None
    tp: int | None = None
    mesh: object = None
    plan: Mapping[str, str] = field(default_factory=dict)
    overlap_reduce: bool = True
    """Average each stage's gradients over the replicas as soon as they are final in the
    step, behind the compute still to come (``reducer``); False: all after the step."""
    ep: int | None = None
    """Expert-parallel ranks per pipeline rank (None: from ``mesh``, else 1)."""
    ep_plan: Mapping[str, str] = field(default_factory=dict)
    """Experts module-name pattern -> ``stacked`` or ``list`` (``transport.experts``)."""
    overlap_pairs: bool = True
    """Run an overlapped pair's two passes at once (``execution.overlap``; never under tensor
    parallelism, whose all-reduces inside both passes would share the ``tp`` group)."""
    dp_replicate: int = 1
    """HSDP: the ``dp`` ranks as this many replica groups of ``dp / dp_replicate`` shards each
    (FSDP2 reduce-scatters within a group and all-reduces across them; 1: plain FSDP)."""

    def grid(self, pp: int, world: int, device: torch.device) -> grids.Grid:
        """The run's ``Grid`` (every rank calls this together)."""
        if self.mesh is None:
            dp, tp, ep = self.dp or 1, self.tp or 1, self.ep or 1
            if pp * dp * tp * ep != world:
                raise ConfigError(f"world size {world} != {pp} pipeline ranks x dp {dp} x "
                                  f"ep {ep} x tp {tp}")
        grid = grids.build(pp, device, self.dp, self.tp, self.mesh,  # type: ignore[arg-type]
                           self.ep)
        grids.hsdp_shape(grid.dp, self.dp_replicate)
        return grid

    def ep_groups(self, grid: grids.Grid) -> tuple[Any, ...]:
        """The experts' groups over ``ep`` (none when ep = 1): two lanes, so an overlapped
        pair's forward and backward never share one (``runtime.execution.overlap``). Every
        rank calls this together."""
        if grid.ep == 1:
            return ()
        return (grid.group("ep"), grid.group_over(("ep",)))

    def apply_ep(self, stages: Mapping[int, StageModule], grid: grids.Grid,
                 groups: Sequence[Any]) -> list[Shard]:
        """Share out the planned experts modules of ``stages`` over the ``ep`` ranks (none when
        ep = 1) on ``groups`` (its lanes, ``ep_groups``); refused when the plan matches no
        module on any rank."""
        if grid.ep == 1:
            return []
        check_layout(grid.ep, grid.tp, self.dp_replicate)
        if not self.ep_plan:
            raise ConfigError(f"ep = {grid.ep} needs an expert-parallel plan (experts "
                              "module-name pattern -> stacked/list); the model gives none")
        done: list[Shard] = []
        for _, stage in sorted(stages.items()):
            names = module_paths(stage, stage.named_global_parameters())
            done += expert_parallel(stage, self.ep_plan, names, groups[0], grid.ep,
                                    grid.coords["ep"], spare=groups[1:])
        mine = None if done else (
            f"the expert-parallel plan {dict(self.ep_plan)} matches no module of stages "
            f"{sorted(stages)}")
        bad = comm.complaints(mine)  # a rank whose stages hold no MoE layer is fine
        if len(bad) == comm.world_size():
            raise ConfigError("expert parallelism refused: " + "; ".join(
                f"rank {r}: {text}" for r, text in sorted(bad.items())))
        return done

    def apply_tp(self, stages: Mapping[int, StageModule], grid: grids.Grid) -> list[str]:
        """Split the planned modules of ``stages`` over the ``tp`` ranks (none when tp = 1)."""
        if grid.tp == 1:
            return []
        if not self.plan:
            raise ConfigError(f"tp = {grid.tp} needs a tensor-parallel plan (module-name "
                              "pattern -> colwise/rowwise); the model gives none")
        sub = grid.sub("tp")
        done: list[str] = []
        for s, stage in sorted(stages.items()):
            names = module_names(stage.named_global_parameters(), stage)
            done += tensor_parallel(stage, sub, self.plan, names, f"stage {s}")  # type: ignore[arg-type]
        mine = None if done else (
            f"the tensor-parallel plan {dict(self.plan)} matches no module of stages "
            f"{sorted(stages)} (a model cut by torch.export has no nn.Linear modules to split)")
        bad = comm.complaints(mine or self._splits_experts(done, grid.ep))
        if bad:
            raise ConfigError("tensor parallelism refused: " + "; ".join(
                f"rank {r}: {text}" for r, text in sorted(bad.items())))
        return done

    def _splits_experts(self, split: Sequence[str], ep: int) -> str | None:
        """What is wrong when the tensor-parallel plan split a module of an experts module
        (with ``ep`` > 1 the experts stay whole on every ``tp`` rank); None when it did not."""
        clash = next(((name, owner) for name in split
                      if ep > 1 and (owner := holder(name, self.ep_plan)) is not None), None)
        if clash is None:
            return None
        return (f"the tensor-parallel plan {dict(self.plan)} splits {clash[0]!r}, a module of "
                f"the experts module {clash[1]!r}: with expert parallelism (ep = {ep}) the "
                "experts stay whole on every tp rank, so the plan must match none of them")
