"""FSDP over the data-parallel group for schedules with the DSL's AG/RS kinds (ZeroPP).

Between uses a stage keeps only its flat parameter shard (``FlatShard.shard``, the tensor the
optimizer steps); the module's parameters are empty. AG all-gathers the shards of the group into
one flat buffer and points the parameters at views of it; RS reduce-scatters (averages) the
gradient accumulated since the last RS into the shard's gradient and, at the last RS of the
gathered runs, frees the full parameters. With one replica the group has one member: the shard
is the whole flat vector and the collectives are copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.transport import comm


class FlatShard:
    """One stage's parameters kept as this DP rank's slice of their flat concatenation."""

    def __init__(self, stage: int, module: StageModule, group: object, size: int,
                 index: int) -> None:
        self.stage, self.module = stage, module
        self.group, self.size, self.index = group, size, index
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ConfigError(f"stage {stage}: FSDP needs one parameter dtype, got {dtypes}")
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        total = sum(self.numels)
        self.chunk = -(-total // size)  # ceil: the flat vector is padded to size x chunk
        flat = self._flat([p.detach() for p in self.params])
        self.shard = torch.nn.Parameter(flat[index * self.chunk:(index + 1) * self.chunk].clone())
        self.gathered = 0
        """How many AGs are open (each RS closes one); 0: parameters freed."""
        self.free()

    def _flat(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """Concatenate ``tensors`` and pad to ``size x chunk``."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, self.size * self.chunk - flat.numel()))

    def gather(self) -> None:
        """AG: all-gather the full parameters (again, if already gathered: values agree)."""
        full = torch.empty(self.size * self.chunk, dtype=self.shard.dtype,
                           device=self.shard.device)
        comm.all_gather_flat(full, self.shard.detach(), self.group, self.size)
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.numels, strict=True):
            p.data = full[offset:offset + n].view(shape)
            offset += n
        self.gathered += 1

    def reduce_scatter(self) -> None:
        """RS: average the gradient accumulated since the last RS into the shard's gradient;
        free the full parameters when no AG is left open."""
        if self.gathered == 0:
            raise RunError(f"stage {self.stage}: RS without an AG before it")
        full = self._flat([torch.zeros(s, dtype=self.shard.dtype, device=self.shard.device)
                           if p.grad is None else p.grad
                           for p, s in zip(self.params, self.shapes, strict=True)])
        part = torch.empty(self.chunk, dtype=full.dtype, device=full.device)
        comm.reduce_scatter_flat(part, full, self.group, self.size)
        part /= self.size
        self.shard.grad = part if self.shard.grad is None else self.shard.grad + part
        for p in self.params:
            p.grad = None
        self.gathered -= 1
        if self.gathered == 0:
            self.free()

    def free(self) -> None:
        """Drop the full parameters (they become empty tensors)."""
        for p in self.params:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def full(self, grads: bool) -> dict[str, torch.Tensor]:
        """The full parameters (or their averaged gradients) by global name, gathered from
        every shard (a collective over the DP group)."""
        part = self.shard.grad if grads else self.shard
        part = torch.zeros_like(self.shard) if part is None else part
        full = torch.empty(self.size * self.chunk, dtype=part.dtype, device=part.device)
        comm.all_gather_flat(full, part.detach(), self.group, self.size)
        by_id = {id(p): name for name, p in self.module.named_global_parameters().items()}
        out, offset = {}, 0
        for p, shape, n in zip(self.params, self.shapes, self.numels, strict=True):
            out[by_id[id(p)]] = full[offset:offset + n].view(shape).clone()
            offset += n
        return out


def uses_fsdp(ops: Sequence[object]) -> bool:
    """Whether a rank's ops gather parameters (any AG)."""
    return any(getattr(op, "kind", None) == "AG" for op in ops)


def shard_stages(stages: Mapping[int, StageModule], group: object, size: int,
                 index: int) -> dict[int, FlatShard]:
    """Shard every stage of this rank over the DP group (``size`` members, this is
    ``index``)."""
    return {s: FlatShard(s, m, group, size, index) for s, m in sorted(stages.items())}


def trainable(stages: Mapping[int, StageModule],
              shards: Mapping[int, FlatShard]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(what the optimizer steps, what the DP all-reduce averages): a sharded stage's shard
    (already averaged by RS), an unsharded stage's parameters."""
    plain: list[torch.Tensor] = [p for s, m in stages.items() if s not in shards
                                 for p in m.parameters()]
    return plain + [sh.shard for sh in shards.values()], plain


def check_closed(shards: Mapping[int, FlatShard], rank: int) -> None:
    """After a step every AG must have its RS (else gradients would be lost)."""
    open_ = [s for s, sh in shards.items() if sh.gathered]
    if open_:
        raise RunError(f"rank {rank}: stage(s) {open_} still gathered after the step: "
                          f"every AG needs an RS after its weight gradients")


def full_named(shards: Mapping[int, FlatShard], grads: bool) -> dict[str, torch.Tensor]:
    """Every sharded stage's full parameters (or gradients) by global name, on the CPU."""
    return {k: v.cpu() for sh in shards.values() for k, v in sh.full(grads).items()}
