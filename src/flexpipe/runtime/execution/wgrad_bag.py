"""The B/W split of ``nn.EmbeddingBag`` (``wgrad``'s store): a bag's input is ids, so its
backward is all weight gradient. B hands the output gradient over; W runs the bag again on
the kept ids (a gather and a sum) and takes torch's own backward of it, so the gradient is
the fused backward's, for every mode (sum, mean, max) and with per-sample weights that take no
gradient."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.runtime.execution.wgrad import WeightWork, accumulate, current, finish, operand, owned


class _Bag(torch.autograd.Function):
    """``embedding_bag``; backward leaves dW (now or in W) and gives nothing else."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor | None,
                per_sample: torch.Tensor | None, work: WeightWork, options: dict[str, Any]
                ) -> torch.Tensor:
        ctx.work, ctx.weight, ctx.options = work, weight, options
        ctx.save_for_backward(ids, offsets, per_sample)
        work.note(weight)
        return fn.embedding_bag(ids, weight.detach(), offsets, per_sample_weights=per_sample,
                                **options)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, ...]:
        saved = ctx.saved_tensors
        ids = saved[0].detach()
        offsets, per_sample = (None if t is None else t.detach() for t in saved[1:])
        weight, options, dy = ctx.weight, ctx.options, dy.detach()

        def closure() -> None:
            with torch.enable_grad():
                w = weight.detach().requires_grad_(True)
                out = fn.embedding_bag(ids, w, offsets, per_sample_weights=per_sample, **options)
                (grad,) = torch.autograd.grad(out, w, dy)
            accumulate(weight, grad)

        finish(ctx.work, closure, *(t for t in (ids, offsets, per_sample, dy) if t is not None))
        return None, None, None, None, None, None


def bag_forward(self: nn.EmbeddingBag, ids: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.EmbeddingBag``'s forward, split while a store records (not a sparse or max-norm
    bag, nor per-sample weights that want a gradient)."""
    work = current()
    wants = per_sample_weights is not None and per_sample_weights.requires_grad
    if work is None or self.sparse or self.max_norm is not None or wants:
        return nn.EmbeddingBag.forward(self, ids, offsets, per_sample_weights)
    weight = self.weight  # read once: a parametrization computes it at every read
    options: dict[str, Any] = {
        "norm_type": self.norm_type, "scale_grad_by_freq": self.scale_grad_by_freq,
        "mode": self.mode, "include_last_offset": self.include_last_offset,
        "padding_idx": self.padding_idx}
    if not owned(weight) or not weight.requires_grad:
        return fn.embedding_bag(ids, weight, offsets, per_sample_weights=per_sample_weights,
                                **options)
    return _Bag.apply(operand(weight), ids, offsets,  # type: ignore[no-any-return]
                      per_sample_weights, work, options)
