"""Gradient reduction hidden behind compute: each stage's gradients start to average over the
data-parallel replicas as soon as they are final in the step, while the rank's other stages
(and the other ranks) still compute.

A parameter's gradient is final after the last op of the step that adds to it (an op kind with
``grads``: B, W, BW) on any of this rank's stages that hold it. At that op the executor calls
``Reducer.ready``, which packs the parameters that became final there into buckets of at most
``bucket_bytes`` (as torch's DDP buckets its gradients) and starts one asynchronous all-reduce
per bucket over the data-parallel group. ``Reducer.finish`` (after the step) waits for every
bucket, divides by the group size and copies the averages back into ``.grad``.

Each element is the same sum over the replicas as one all-reduce of every gradient after the
step would give: with two replicas bit for bit; with more, up to the order the collective adds
the replicas' values in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from flexpipe.ir.kinds import KINDS
from flexpipe.ir.op import Op
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import local

BUCKET_BYTES = 25 * 2**20
"""The most gradient bytes one asynchronous all-reduce carries (torch DDP's default)."""


@dataclass
class _Bucket:
    """One flat buffer in flight and the gradients it averages."""

    grads: list[torch.Tensor]
    flat: torch.Tensor
    work: object


@dataclass
class Reducer:
    """Starts the averaging of this rank's replicated gradients stage by stage (``ready``) and
    completes it after the step (``finish``)."""

    group: object
    size: int
    final_at: dict[int, list[torch.Tensor]]
    """Op index -> the parameters whose gradients are final after that op."""
    bucket_bytes: int = BUCKET_BYTES
    started: list[int] = field(default_factory=list)
    """The op indices at which buckets were started this step (in order)."""
    flying: list[_Bucket] = field(default_factory=list)

    @classmethod
    def of(cls, ops: Sequence[Op], stages: Mapping[int, torch.nn.Module],
           params: Sequence[torch.Tensor], group: object, size: int,
           bucket_bytes: int = BUCKET_BYTES) -> Reducer:
        """The reducer of ``params`` (the gradients the replicas hold in full) for a rank
        running ``ops`` over ``stages``."""
        last = {op.stage: i for i, op in enumerate(ops) if KINDS[op.kind].grads}
        wanted = {id(p) for p in params}
        final: dict[int, int] = {}
        order: dict[int, torch.Tensor] = {}
        p: torch.Tensor
        for s, module in stages.items():
            for p in module.parameters():
                if id(p) in wanted and s in last:
                    final[id(p)] = max(final.get(id(p), -1), last[s])
                    order[id(p)] = p
        final_at: dict[int, list[torch.Tensor]] = {}
        for key, p in order.items():
            final_at.setdefault(final[key], []).append(p)
        return cls(group, size, final_at, bucket_bytes)

    @cached_property
    def covered(self) -> frozenset[int]:
        """The ids of every parameter this reducer averages."""
        return frozenset(id(p) for ps in self.final_at.values() for p in ps)

    def ready(self, index: int) -> None:
        """The op at ``index`` is done: start averaging what became final there."""
        params = self.final_at.get(index)
        if not params or self.size == 1:
            return
        grads = [local(p.grad) for p in params if p.grad is not None]
        for bucket in _buckets(grads, self.bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            work = comm.all_reduce_start(flat, self.group)
            self.flying.append(_Bucket(bucket, flat, work))
        self.started.append(index)

    def finish(self) -> None:
        """Wait for every bucket of the step and write the averages back."""
        for bucket in self.flying:
            bucket.work.wait()  # type: ignore[attr-defined]
            bucket.flat /= self.size
            offset = 0
            for g in bucket.grads:
                g.copy_(bucket.flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.flying = []

    def reset(self) -> None:
        """Forget the last step's launch points (a new step begins)."""
        self.started = []


def _buckets(grads: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """``grads`` in order, packed into runs of at most ``limit`` bytes (one same-dtype run
    each; a gradient larger than ``limit`` alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if not out or size + nbytes > limit or out[-1][0].dtype != g.dtype:
            out.append([])
            size = 0
        out[-1].append(g)
        size += nbytes
    return out
