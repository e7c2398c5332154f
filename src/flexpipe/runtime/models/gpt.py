"""A small built-in GPT (decoder-only transformer) given as a list of layers, the form the
runtime partitions into stages: ``[Embedding, Block x layers, Head]``, plus its loss.

Dropout (``GPTConfig.dropout``, GPT-2's residual dropout) is off by default; with a run seed
(``TrainConfig.seed``) its masks do not depend on the schedule
(``flexpipe.runtime.execution.rng``), so a pipelined run and a single-device run compute the same
numbers either way."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.selective import Core


@dataclass(frozen=True)
class GPTConfig:
    """Model shape."""

    vocab: int = 256
    """Vocabulary size."""
    hidden: int = 64
    """Hidden size h."""
    heads: int = 4
    """Attention heads a (h must be a multiple)."""
    layers: int = 4
    """Transformer blocks."""
    seq: int = 32
    """Longest sequence (positions)."""
    dropout: float = 0.0
    """Dropout on the attention and MLP outputs before the residual adds (0: none)."""


class Embedding(nn.Module):
    """Token plus learned position embedding: token ids (b, s) -> hidden states (b, s, h)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq, cfg.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embed ``ids``."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4h MLP, both residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.hidden % cfg.heads:
            raise ValueError(f"hidden {cfg.hidden} is not a multiple of heads {cfg.heads}")
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.up = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.down = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.core = Core(_causal_core)
        """The attention core (scores, softmax, weighted values): what SR recomputes."""
        self.drop: nn.Module = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal multi-head self-attention. ``qkv``'s output features are grouped by head
        (each head's query, key and value together), so a column split of ``qkv`` over
        tensor-parallel ranks gives each rank whole heads: the head count here is what the
        features present (all heads, or this rank's)."""
        q, k, v = self.qkv(x).unflatten(-1, (-1, 3, self.head_dim)).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        x = x + self.drop(self.attention(self.norm1(x)))
        return x + self.drop(self.down(fn.gelu(self.up(self.norm2(x)))))


TP_PLAN = {"*.qkv": "colwise", "*.proj": "rowwise", "*.up": "colwise", "*.down": "rowwise"}
"""Megatron-LM's tensor-parallel split of a block: the attention heads (``qkv`` by columns,
``proj`` by rows) and the MLP (``up`` by columns, ``down`` by rows), one all-reduce after each
in the forward and one before each in the backward. Embedding and head stay whole."""


def tp_plan(cfg: GPTConfig, tp: int) -> dict[str, str]:
    """The tensor-parallel plan of the GPT for ``tp`` ranks (the heads must divide evenly)."""
    if tp > 1 and cfg.heads % tp:
        raise ConfigError(f"tp = {tp} does not divide the GPT's {cfg.heads} attention heads")
    return dict(TP_PLAN)


def _causal_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention of (b, heads, s, d) queries, keys and values."""
    return fn.scaled_dot_product_attention(q, k, v, is_causal=True)


class Head(nn.Module):
    """Final LayerNorm and the language-model head: hidden states -> logits (b, s, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.out(self.norm(x))


def gpt_layers(cfg: GPTConfig) -> list[nn.Module]:
    """The model as a list of layers: embedding, ``cfg.layers`` blocks, head."""
    layers: list[nn.Module] = [Embedding(cfg)]
    layers += [Block(cfg) for _ in range(cfg.layers)]
    layers.append(Head(cfg))
    for layer in layers:
        _init(layer, cfg)
    return layers


def _init(layer: nn.Module, cfg: GPTConfig) -> None:
    """GPT-2 style initialisation (normal, std 0.02; residual projections scaled)."""
    for name, p in layer.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * cfg.layers) if name.split(".")[0] in ("proj", "down") \
                else 0.02
            nn.init.normal_(p, std=std)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, averaged over tokens."""
    return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
