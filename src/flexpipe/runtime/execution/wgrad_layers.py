"""The split forwards of torch's own layers with weights (``wsplit.SPLIT_FORWARDS`` names them):
``nn.Linear``, ``nn.Embedding`` (an autograd function whose backward leaves the scatter of dY to
W) and ``nn.MultiheadAttention``'s projections, with or without the attention weights
(``wgrad_attention``). Each reads its layer's weights once (a parametrization computes them at
every read), splits while a store records (``wgrad.recording``) and where they are weights
(``wgrad.owned``), and otherwise runs as torch runs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.runtime.execution.wgrad import (
    WeightWork,
    accumulate,
    current,
    finish,
    operand,
    owned,
    split_linear,
    weight_operand,
)


def linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear``'s forward, split while a store records."""
    work, weight, bias = current(), self.weight, self.bias  # read once: maybe computed
    if work is None or not owned(weight, bias):
        return fn.linear(x, weight, bias)
    return split_linear(x, weight, bias, work)


class _Embedding(torch.autograd.Function):
    """A dense embedding lookup (``padding_idx`` -1: none); its weight gradient (a scatter of
    dy) now or in W."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, work: WeightWork,
                padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
        ctx.work, ctx.weight, ctx.pad, ctx.scale = work, weight, padding_idx, scale_grad_by_freq
        work.note(weight)
        ctx.save_for_backward(ids)
        return torch.ops.aten.embedding(weight, ids, padding_idx, scale_grad_by_freq, False)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, None, None, None, None]:
        ids = ctx.saved_tensors[0].detach()
        weight, pad, scale = ctx.weight, ctx.pad, ctx.scale
        if ctx.needs_input_grad[1]:
            def closure() -> None:
                accumulate(weight, torch.ops.aten.embedding_dense_backward(
                    dy, ids, weight.shape[0], pad, scale))
            finish(ctx.work, closure, ids, dy)
        return None, None, None, None, None


def split_embedding(ids: torch.Tensor, weight: torch.Tensor, work: WeightWork,
                    padding_idx: int = -1, scale_grad_by_freq: bool = False) -> torch.Tensor:
    """``aten.embedding`` whose weight gradient goes through ``work`` (``padding_idx`` -1 or a
    row index)."""
    return _Embedding.apply(ids, operand(weight), work, padding_idx,  # type: ignore[no-any-return]
                            scale_grad_by_freq)


def embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``nn.Embedding``'s forward, split while a store records (not a sparse or max-norm
    one)."""
    work = current()
    if work is None or self.sparse or self.max_norm is not None:
        return nn.Embedding.forward(self, ids)
    weight = self.weight  # read once: a parametrization computes it at every read
    if not owned(weight):
        return fn.embedding(ids, weight, self.padding_idx, None, self.norm_type,
                            self.scale_grad_by_freq, False)
    pad = -1 if self.padding_idx is None else self.padding_idx
    return split_embedding(ids, weight, work, pad, self.scale_grad_by_freq)


def mha_forward(self: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                 need_weights: bool = True, attn_mask: torch.Tensor | None = None,
                 average_attn_weights: bool = True, is_causal: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention``'s forward, its projections split while a store records
    (plain self-attention, the weights asked for or not; anything else as torch runs it)."""
    work = current()
    causal_weights = need_weights and is_causal and attn_mask is None  # torch refuses it
    if work is None or causal_weights or not _plain_self_attention(self, query, key, value) \
            or not _plain_weights(self):
        return nn.MultiheadAttention.forward(
            self, query, key, value, key_padding_mask=key_padding_mask,
            need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=is_causal)
    from flexpipe.runtime.execution.wgrad_attention import self_attention

    return self_attention(self, query, key_padding_mask, attn_mask, is_causal,
                          lambda x, w, b: split_linear(x, w, b, work), need_weights,
                          average_attn_weights)


def _plain_self_attention(mha: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor) -> bool:
    """Self-attention with packed projections and nothing exotic: the case split here."""
    return (query is key and key is value and mha._qkv_same_embed_dim and mha.bias_k is None
            and not mha.add_zero_attn and query.dim() == 3)


def _plain_weights(mha: nn.MultiheadAttention) -> bool:
    """Its projections' weights are parameters (or frozen), not computed: the split reads
    them again, and a parametrization would compute them anew."""
    return all(w is None or not w.requires_grad or weight_operand(w) for w in (
        mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias))
