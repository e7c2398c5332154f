"""A mixture of experts of one's own, as a chain of layers: embedding, MoE layers, head. Each
MoE layer is residual: a linear router's softmax top-k, then its experts (an ``nn.ModuleList``
of two-layer MLPs: the ``list`` style of an expert-parallel plan, ``PLAN``) with Hugging Face's
contract ``(hidden, top_k_index, top_k_weights)``. The router's Switch-style load-balancing
term (E x sum_e share of tokens_e x mean probability_e) travels with the hidden states, summed
over the layers, so the loss at the last stage can add it (``loss``). The expert-parallel tests
train it tiny in float64; ``benchmarks/dualpipe_overlap.py`` times it sized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as fn

PLAN = {"*.moe": "list"}
"""Its expert-parallel plan: each layer's ``moe`` holds its experts as a list."""


@dataclass(frozen=True)
class MoESize:
    """The model's sizes."""

    vocab: int = 32
    hidden: int = 16
    experts: int = 4
    top_k: int = 2
    blocks: int = 4
    aux: float = 0.1
    """The balancing loss's coefficient (Hugging Face's ``router_aux_loss_coef``)."""


class Expert(nn.Module):
    """One expert: a two-layer MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(fn.gelu(self.up(x)))  # type: ignore[no-any-return]


class Experts(nn.Module):
    """The experts of one layer: (hidden, top-k ids, top-k weights) -> each token's weighted
    sum of its experts' outputs."""

    def __init__(self, hidden: int, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(hidden) for _ in range(count))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            out = out.index_add(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    """A residual MoE layer and the running sum of the layers' balancing terms."""

    def __init__(self, hidden: int, count: int, top_k: int) -> None:
        super().__init__()
        self.count, self.top_k = count, top_k
        self.router = nn.Linear(hidden, count, bias=False)
        self.moe = Experts(hidden, count)

    def forward(self, h: torch.Tensor, aux: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        flat = h.reshape(-1, h.shape[-1])
        probs = self.router(flat).softmax(-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        out = h + self.moe(flat, ids, weights / weights.sum(-1, keepdim=True)).view_as(h)
        share = fn.one_hot(ids, self.count).sum(1).to(probs.dtype).mean(0)
        term = self.count * (share * probs.mean(0)).sum()
        return out, term if aux is None else aux + term


class Head(nn.Module):
    """The language-model head (the balancing loss passes through)."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.out = nn.Linear(hidden, vocab)

    def forward(self, h: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.out(h), aux


def layers(size: MoESize = MoESize(), seed: int | None = 0) -> list[nn.Module]:
    """The chain (float32; torch seeded with ``seed`` first unless None): embedding,
    ``size.blocks`` MoE layers, head."""
    if seed is not None:
        torch.manual_seed(seed)
    return [nn.Embedding(size.vocab, size.hidden),
            *(MoEBlock(size.hidden, size.experts, size.top_k) for _ in range(size.blocks)),
            Head(size.hidden, size.vocab)]


def loss(size: MoESize = MoESize()) -> Callable[..., torch.Tensor]:
    """The chain's loss: next-token cross-entropy plus ``size.aux`` x the balancing term."""

    def total(logits: torch.Tensor, aux: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ce = fn.cross_entropy(logits.reshape(-1, size.vocab), target.reshape(-1))
        return ce + size.aux * aux

    return total
