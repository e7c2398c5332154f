"""``gpt-vocab``: a GPT whose embedding and output head are sharded over the vocabulary, one
shard per pipeline rank -- the runtime model of the ``gpt-sharded-vocab`` preset
(``flexpipe.graphs.presets``), whose gangs it executes for real.

Segments, for p = ``spec.shards``: sources ``embed0..embed{p-1}`` (each reads the token ids and
looks up its slice of the vocabulary, zeros for ids outside it), ``body`` after all of them (sums
the p partial embeddings and adds the position embedding, then the GPT ``Block``s, then a final
LayerNorm), and sinks ``head0..head{p-1}`` after ``body`` (each the logits of its vocabulary
slice, and the slice's offset). The join into ``body`` is the embedding's reduce and the fork
out of it the hidden state's broadcast, as the preset's edges model them.

The loss (``VocabLoss``) is vocabulary-parallel cross-entropy: each head shard's forward
all-reduces over the head gang's ranks (``flexpipe.runtime.transport.comm``) the maximum logit,
then the sum of exponentials and the target's logit, so every shard knows the full CE and
returns CE/p (the sinks' losses sum to the CE); its backward is the local slice of the true
gradient (softmax - one-hot) / N. That all-reduce is the head gang's collective F; its B (the
input gradient's sum) is the body's sum of the p heads' gradients. The single-process reference
computes one CE over the concatenated slices (``VocabLoss.joint``).

Only plain pipelines: the head gang is every rank of the world (dp = tp = 1, p = pipeline
ranks); ``check_vocab_job`` refuses anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.execution.stage import LossFn
from flexpipe.runtime.models.gpt import Block
from flexpipe.runtime.models.spec import ModelSpec, seeded_segments
from flexpipe.runtime.transport import comm

STD = 0.02
"""Standard deviation of the embedding and head weights (GPT-2 style)."""


def slice_of(vocab: int, shards: int, shard: int) -> tuple[int, int]:
    """(first id, size) of vocabulary slice ``shard`` of ``shards``."""
    size = vocab // shards
    return shard * size, size


class ShardEmbed(nn.Module):
    """Token ids (b, s) -> the embedding rows of this vocabulary slice (zeros for other ids)."""

    def __init__(self, vocab: int, hidden: int, shards: int, shard: int) -> None:
        super().__init__()
        self.first, self.size = slice_of(vocab, shards, shard)
        self.tok = nn.Embedding(self.size, hidden)
        nn.init.normal_(self.tok.weight, std=STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The partial embedding (b, s, h)."""
        local = ids - self.first
        inside = (local >= 0) & (local < self.size)
        rows = self.tok(local.clamp(0, self.size - 1))
        return rows * inside.unsqueeze(-1).to(rows.dtype)  # type: ignore[no-any-return]


class SumEmbed(nn.Module):
    """The p partial embeddings -> their sum plus the position embedding."""

    def __init__(self, seq: int, hidden: int) -> None:
        super().__init__()
        self.pos = nn.Embedding(seq, hidden)
        nn.init.normal_(self.pos.weight, std=STD)

    def forward(self, *parts: torch.Tensor) -> torch.Tensor:
        """Hidden states (b, s, h)."""
        pos = torch.arange(parts[0].shape[1], device=parts[0].device)
        return torch.stack(parts).sum(dim=0) + self.pos(pos)


class ShardHead(nn.Module):
    """Hidden states -> (logits of this vocabulary slice, the slice's first id as a tensor)."""

    def __init__(self, vocab: int, hidden: int, shards: int, shard: int) -> None:
        super().__init__()
        self.first, size = slice_of(vocab, shards, shard)
        self.out = nn.Linear(hidden, size, bias=False)
        nn.init.normal_(self.out.weight, std=STD)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (b, s, vocab / p) and the offset."""
        return self.out(x), torch.tensor(self.first, device=x.device)


class _ParallelCE(torch.autograd.Function):
    """CE/p of one vocabulary slice's logits, with the statistics all-reduced over the
    group; backward: the slice of the true gradient."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor,  # type: ignore[override]
                first: int, shards: int) -> torch.Tensor:
        z = logits.detach().reshape(-1, logits.shape[-1])
        local = target.reshape(-1) - first
        inside = (local >= 0) & (local < z.shape[1])
        local = local.clamp(0, z.shape[1] - 1)
        zmax = z.max(dim=1).values
        comm.all_reduce_max(zmax)
        exp = torch.exp(z - zmax[:, None])
        picked = z.gather(1, local[:, None]).squeeze(1) * inside.to(z.dtype)
        sums = torch.stack([exp.sum(dim=1), picked])
        comm.all_reduce_sum([sums], None)
        ce = (torch.log(sums[0]) + zmax - sums[1]).mean()
        ctx.save_for_backward(exp / sums[0][:, None], local, inside)
        ctx.shape = logits.shape
        return ce / shards

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        soft, local, inside = ctx.saved_tensors
        rows = torch.arange(soft.shape[0], device=soft.device)
        delta = soft.clone()
        delta[rows, local] -= inside.to(soft.dtype)
        # every shard's copy of the CE depends on this slice: p copies x (1/p) each
        return (delta * (grad / soft.shape[0])).reshape(ctx.shape), None, None, None


class VocabLoss:
    """Vocabulary-parallel cross-entropy (callable as a sink's loss: logits slice, offset,
    target) over ``shards`` head shards on every rank of the world."""

    def __init__(self, shards: int) -> None:
        self.shards = shards

    def __call__(self, logits: torch.Tensor, first: torch.Tensor,
                 target: torch.Tensor) -> torch.Tensor:
        """CE/p of the micro-batch (collective: every head shard calls it for the micro-batch
        at the same point of its rank's schedule, as the head gang's F)."""
        if comm.world_size() != self.shards:
            raise ConfigError(f"gpt-vocab's loss all-reduces over its {self.shards} head shards, "
                              f"one per rank of the world; the world has {comm.world_size()} "
                              "ranks (run it as a plain pipeline: dp = tp = 1)")
        out: torch.Tensor = _ParallelCE.apply(logits, target, int(first), self.shards)
        return out

    def joint(self, outs: Sequence[Sequence[torch.Tensor]], target: torch.Tensor) -> torch.Tensor:
        """The single-process loss of the sinks' outputs together: one CE over the slices
        concatenated in vocabulary order."""
        parts = sorted(outs, key=lambda out: int(out[1]))
        logits = torch.cat([out[0] for out in parts], dim=-1)
        return fn.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def check_vocab(spec: ModelSpec) -> None:
    """``ConfigError`` unless the vocabulary splits into ``spec.shards`` >= 2 equal slices."""
    if spec.shards < 2:
        raise ConfigError(f"gpt-vocab shards its vocabulary over shards >= 2 ranks, got "
                          f"{spec.shards}")
    if spec.vocab % spec.shards:
        raise ConfigError(f"gpt-vocab: vocab {spec.vocab} is not divisible by shards "
                          f"{spec.shards} (each head and embedding shard holds vocab / shards "
                          "ids)")


def check_vocab_job(spec: ModelSpec, pp: int, dp: int, tp: int) -> None:
    """``ConfigError`` unless ``spec`` can run on ``pp`` pipeline ranks x ``dp`` x ``tp``."""
    check_vocab(spec)
    if dp > 1 or tp > 1:
        raise ConfigError(f"gpt-vocab runs as a plain pipeline only (dp {dp}, tp {tp} given): "
                          "its loss all-reduces over the world as the head gang, which is the "
                          "pipeline ranks only when dp = tp = 1")
    if spec.shards != pp:
        raise ConfigError(f"gpt-vocab has {spec.shards} shards but the schedule has {pp} "
                          "pipeline ranks: one embedding and one head shard per rank")


def vocab_segments(spec: ModelSpec) -> list[Segment]:
    """``embed0..``, ``body``, ``head0..`` (seeded by the caller)."""
    check_vocab(spec)
    p, h = spec.shards, spec.hidden
    embeds = [Segment(f"embed{k}", (ShardEmbed(spec.vocab, h, p, k),), feeds=(0,))
              for k in range(p)]
    body = (SumEmbed(spec.seq, h), *(Block(spec.gpt()) for _ in range(spec.layers)),
            nn.LayerNorm(h))
    heads = [Segment(f"head{k}", (ShardHead(spec.vocab, h, p, k),), after=("body",))
             for k in range(p)]
    return [*embeds, Segment("body", body, after=tuple(s.name for s in embeds)), *heads]


def gpt_vocab(spec: ModelSpec) -> tuple[list[Segment], LossFn]:
    """The model's segments (seeded, in ``spec.dtype``) and its loss."""
    return seeded_segments(spec, vocab_segments), VocabLoss(spec.shards)
