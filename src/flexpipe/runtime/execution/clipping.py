"""Clipping the whole model's gradient over the pipeline's ranks, as
``torch.nn.utils.clip_grad_norm_`` clips one process's: the total norm counts every logical
parameter once, wherever it lives, and every rank scales its gradients by the same factor.

Each rank takes the norm of the gradients it owns with torch's own ``get_total_norm`` (a
DTensor's, sharded by FSDP2 or tensor parallelism, over its whole mesh, one mesh at a time:
FSDP2 with tensor parallelism holds DTensors of two), leaving out the copies of a tied weight
held by a rank that is not the tie's first (the copies are equal after the step), and under
DualPipe the copies of the way up (``twoway.Twins``: equal to those of the way down after the
step). The parts are combined over the pipeline ranks of the replica (sum of p-th powers, or
the maximum for the infinity norm); the replicas hold the same averaged gradients, so they
agree without more communication. Under expert parallelism the experts' gradients, different
on each ``ep`` rank, are taken apart over the pipeline and ``ep`` ranks and the two norms
joined. Then every gradient, tied copies included, is multiplied by
``min(1, max_norm / (total + 1e-6))``, torch's factor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from flexpipe.errors import RunError
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import full, quiet, sharded


def owned(params: Sequence[torch.Tensor], tied: Sequence[tuple[torch.Tensor, object]]
          ) -> list[torch.Tensor]:
    """``params`` without the tied copies whose tie another rank leads (the first rank of the
    tie's group counts it)."""
    others = {id(p) for p, group in tied if not comm.leads(group)}
    return [p for p in params if id(p) not in others]


def total_norm(params: Sequence[torch.Tensor], group: object, norm_type: float
               ) -> torch.Tensor:
    """The norm of the gradients of ``params`` of every rank of ``group`` (None: this rank
    alone), as one float64 tensor on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    parts = [_norm(kind, norm_type) for kind in _by_mesh(grads)]
    mine = torch.tensor(parts, dtype=torch.float64).reshape(-1)
    infinite = math.isinf(norm_type)
    mine = mine.max() if infinite else (mine ** norm_type).sum()
    if group is not None:
        if infinite:
            comm.all_reduce_max(mine, group)
        else:
            comm.all_reduce_sum([mine], group)
    return mine if infinite else mine ** (1.0 / norm_type)


def _by_mesh(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``grads`` in groups torch's ``get_total_norm`` takes at once: the plain tensors, then
    the DTensors of each mesh in the order met (FSDP2's ``dp`` shards and, under tensor
    parallelism, its ``(dp, tp)`` ones are DTensors of two meshes)."""
    meshes: list[Any] = []
    for g in grads:
        if sharded(g) and not any(g.device_mesh == m for m in meshes):  # type: ignore[attr-defined]
            meshes.append(g.device_mesh)  # type: ignore[attr-defined]
    return [[g for g in grads if not sharded(g)], *(
        [g for g in grads if sharded(g) and g.device_mesh == m]  # type: ignore[attr-defined]
        for m in meshes)]


def _norm(grads: list[torch.Tensor], norm_type: float) -> float:
    """The norm of ``grads`` (plain tensors, or DTensors of one mesh), by torch's
    ``get_total_norm``."""
    if not grads:
        return 0.0
    with quiet():
        return float(full(torch.nn.utils.get_total_norm(grads, norm_type)))


def scale(params: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Multiply every gradient of ``params`` by torch's clipping factor for ``total``."""
    factor = min(1.0, max_norm / (float(total) + 1e-6))
    if factor < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)


def _experts_group(worker: Any) -> Any:
    """The group of the pipeline and expert-parallel ranks of the worker's replica: every
    rank's own experts (made on the first clip, every rank calling it together)."""
    group = worker.clip_experts_group
    if group is None:
        group = worker.grid.group_over(("pp", "ep"))
        worker.clip_experts_group = group
    return group


def _joined(a: torch.Tensor, b: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of two disjoint sets of gradients from their norms."""
    if math.isinf(norm_type):
        return torch.maximum(a, b)
    return (a ** norm_type + b ** norm_type) ** (1.0 / norm_type)


def clip_worker(worker: Any, max_norm: float, norm_type: float = 2.0,
                error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a ``RankWorker``'s parameters by the whole model's norm (the
    pipeline ranks of its replica together); the total norm (float64, the same on every rank).
    ``Pipeline.clip_grad_norm_`` and ``flexpipe run --max-norm`` both clip here."""
    params = worker.optimized
    mine = owned(params, worker.tied)
    if worker.twins is not None:  # DualPipe: each model stage's copy on the way down counts
        mine = worker.twins.counted(mine)
    experts = {id(p) for shard in worker.experts for p in shard.params}
    total = total_norm([p for p in mine if id(p) not in experts], worker.grid.group("pp"),
                       float(norm_type))
    if worker.ep > 1:
        total = _joined(total, total_norm([p for p in mine if id(p) in experts],
                                          _experts_group(worker), float(norm_type)), norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RunError(f"the total norm of order {norm_type} of the gradients is "
                       f"{float(total)}: not finite, so they cannot be clipped")
    scale(params, max_norm, total)
    return total
