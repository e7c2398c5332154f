"""``nn.MultiheadAttention`` self-attention with split projections: the computation of
``torch.nn.functional.multi_head_attention_forward`` for a batched self-attention, without
attention weights (what ``nn.TransformerEncoderLayer`` asks for: torch's fused kernel) or
with them (``need_weights``, the layer's default: scores, softmax and a batched product), with
the packed input projection and the output projection given as a function (the
weight-gradient store's linear)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as fn

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = masked out) as an additive float mask; a float mask as is."""
    if mask is None or mask.is_floating_point():
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _joint_mask(mha: nn.MultiheadAttention, n: int, length: int,
                key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask of shape broadcastable to (n, heads, length, length), or None."""
    heads = mha.num_heads
    mask = _float_mask(attn_mask, dtype)
    if mask is not None:
        mask = mask.view(1, 1, length, length) if mask.dim() == 2 \
            else mask.view(n, heads, length, length)
    pad = _float_mask(key_padding_mask, dtype)
    if pad is not None:
        pad = pad.view(n, 1, 1, length)
        mask = pad if mask is None else mask + pad
    return mask


def self_attention(mha: nn.MultiheadAttention, x: torch.Tensor,
                   key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
                   is_causal: bool, linear: Linear, need_weights: bool = False,
                   average: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mha(x, x, x, ...)`` with its projections computed by ``linear``: the output and,
    with ``need_weights``, the attention weights (averaged over heads with ``average``).
    Laid out step by step as torch lays it out (sequence-major, contiguous heads), so the
    attention kernel does the same work and a dropout in it draws the same mask."""
    xs = x.transpose(0, 1) if mha.batch_first else x
    length, n, embed = xs.shape
    heads, head = mha.num_heads, embed // mha.num_heads
    qkv = linear(xs, mha.in_proj_weight, mha.in_proj_bias)
    qkv = qkv.unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = (t.view(length, n * heads, head).transpose(0, 1) for t in qkv)
    mask = _joint_mask(mha, n, length, key_padding_mask, attn_mask, x.dtype)
    dropout = mha.dropout if mha.training else 0.0
    if need_weights:
        y, weights = _weighted(q, k, v, mask, dropout, (n, heads))
    else:
        q, k, v = (t.view(n, heads, length, head) for t in (q, k, v))
        y = fn.scaled_dot_product_attention(q, k, v, mask, dropout, is_causal and mask is None)
        y, weights = y.permute(2, 0, 1, 3), None
    out = linear(y.reshape(length * n, embed), mha.out_proj.weight,
                 mha.out_proj.bias).view(length, n, embed)
    if weights is not None and average:
        weights = weights.mean(dim=1)
    return (out.transpose(0, 1) if mha.batch_first else out), weights


def _weighted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              dropout: float, groups: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that returns its weights, as torch computes it then (scaled scores, the
    additive mask, softmax, dropout, a batched product): the output, sequence-major, and
    the weights per (batch entry, head)."""
    n, heads = groups
    batch, length, head = q.shape
    scaled = q * math.sqrt(1.0 / float(head))
    if mask is None:
        scores = torch.bmm(scaled, k.transpose(-2, -1))
    else:
        full = mask.expand(n, heads, length, length).reshape(batch, length, length)
        scores = torch.baddbmm(full, scaled, k.transpose(-2, -1))
    weights = fn.softmax(scores, dim=-1)
    if dropout > 0.0:
        weights = fn.dropout(weights, p=dropout)
    y = torch.bmm(weights, v).transpose(0, 1)
    return y, weights.view(n, heads, length, length)
