"""``nn.MultiheadAttention`` self-attention with split projections: the computation of
``torch.nn.functional.multi_head_attention_forward`` for a batched self-attention without
attention weights (what ``nn.TransformerEncoderLayer`` asks for), with the packed input
projection and the output projection given as a function (the weight-gradient store's linear).
"""

from __future__ import annotations

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
                   is_causal: bool, linear: Linear) -> torch.Tensor:
    """``mha(x, x, x, need_weights=False)[0]`` with its projections computed by ``linear``.
    Laid out step by step as torch lays it out (sequence-major, contiguous heads), so the
    attention kernel does the same work and a dropout after it draws the same mask."""
    xs = x.transpose(0, 1) if mha.batch_first else x
    length, n, embed = xs.shape
    heads, head = mha.num_heads, embed // mha.num_heads
    qkv = linear(xs, mha.in_proj_weight, mha.in_proj_bias)
    qkv = qkv.unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()
    q, k, v = (t.view(length, n * heads, head).transpose(0, 1).view(n, heads, length, head)
               for t in qkv)
    mask = _joint_mask(mha, n, length, key_padding_mask, attn_mask, x.dtype)
    causal = is_causal and mask is None
    dropout = mha.dropout if mha.training else 0.0
    y = fn.scaled_dot_product_attention(q, k, v, mask, dropout, causal)
    out = linear(y.permute(2, 0, 1, 3).reshape(length * n, embed), mha.out_proj.weight,
                 mha.out_proj.bias).view(length, n, embed)
    return out.transpose(0, 1) if mha.batch_first else out
