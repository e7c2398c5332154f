"""Built-in models and their data (``flexpipe.runtime.models.kinds`` names them): ``gpt`` (the
small GPT on the synthetic text) and ``mlp`` (a two-stream MLP whose stage boundaries carry three
tensors of different shapes and dtypes, one of them integer, to exercise multi-tensor
transfers); ``moe`` (a mixture of experts, ``models.moe``, on the synthetic text); ``clip``
(two towers joined in a contrastive loss, a graph model: ``flexpipe.runtime.models.graph``)
draws its image and text pairs here. Every rank builds the same model from the same seed and
keeps its own stages."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.runtime.execution.stage import LossFn
from flexpipe.runtime.models import moe
from flexpipe.runtime.models.data import TextData
from flexpipe.runtime.models.gpt import gpt_layers, lm_loss
from flexpipe.runtime.models.spec import ModelSpec, spec_model


class Lift(nn.Module):
    """(x, ids) -> (h, x, ids): the first layer of the two-stream MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Lift."""
        return torch.tanh(self.lin(x)), x, ids


class TwoStream(nn.Module):
    """(h, x, ids) -> (h', x', ids): a residual MLP on h that also updates the skip stream x."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.f = nn.Linear(2 * d, 2 * d)
        self.g = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor, x: torch.Tensor,
                ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One layer."""
        h = h + fn.gelu(self.f(h))
        return h, x + torch.tanh(self.g(h)), ids


class Classify(nn.Module):
    """(h, x, ids) -> logits; the integer ids pick a per-id bias."""

    def __init__(self, d: int, classes: int, ids: int) -> None:
        super().__init__()
        self.out = nn.Linear(3 * d, classes)
        self.bias = nn.Embedding(ids, classes)

    def forward(self, h: torch.Tensor, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits."""
        return self.out(torch.cat([h, x], dim=-1)) + self.bias(ids)


def gpt_chain(spec: ModelSpec) -> tuple[list[nn.Module], LossFn]:
    """The small GPT's layers and its loss."""
    return gpt_layers(spec.gpt()), lm_loss


def moe_chain(spec: ModelSpec) -> tuple[list[nn.Module], LossFn]:
    """The mixture of experts' layers (``models.moe``: ``spec.layers`` MoE layers of
    ``spec.experts`` experts, top-2) and its loss (cross-entropy plus the balancing term)."""
    size = moe.MoESize(spec.vocab, spec.hidden, spec.experts, 2, spec.layers)
    return moe.layers(size, seed=None), moe.loss(size)


def mlp_chain(spec: ModelSpec) -> tuple[list[nn.Module], LossFn]:
    """The two-stream MLP's layers and its loss."""
    d = spec.hidden
    return [Lift(d), *(TwoStream(d) for _ in range(spec.layers)),
            Classify(d, spec.vocab, 8)], fn.cross_entropy


Sample = tuple[tuple[torch.Tensor, ...], torch.Tensor]
"""One micro-batch: its inputs and its target."""

IMAGE = (3, 8, 8)
"""Shape of one ``clip`` image (channels, height, width)."""


def text_sample(spec: ModelSpec, index: int) -> Sample:
    """Micro-batch ``index`` of the synthetic text (next-token targets)."""
    x, y = TextData(spec.vocab, spec.seq, spec.seed).batch(index, spec.micro_batch)
    return (x,), y


def mlp_sample(spec: ModelSpec, index: int) -> Sample:
    """Micro-batch ``index`` of the two-stream MLP: features, integer ids and classes."""
    gen = torch.Generator().manual_seed(spec.seed * 7919 + index)
    x = torch.randn(spec.micro_batch, spec.hidden, generator=gen, dtype=spec.torch_dtype)
    ids = torch.randint(0, 8, (spec.micro_batch,), generator=gen)
    y = torch.randint(0, spec.vocab, (spec.micro_batch,), generator=gen)
    return (x, ids), y


def user_sample(spec: ModelSpec, index: int) -> Sample:
    """Your own model's micro-batch ``index`` (``flexpipe.runtime.user.model``)."""
    return spec_model(spec).sample(index, spec.seed)


def pair_sample(spec: ModelSpec, index: int) -> Sample:
    """Matching (image, caption) pairs: both drawn around one of 8 latent classes (an image
    prototype; caption tokens near ``3 x class``, 0 = padding at the end); the target of the
    contrastive loss is the diagonal (sample i matches caption i)."""
    protos = torch.randn(8, *IMAGE, generator=torch.Generator().manual_seed(spec.seed),
                         dtype=spec.torch_dtype)
    gen = torch.Generator().manual_seed(spec.seed * 7919 + index)
    b = spec.micro_batch
    latent = torch.randint(0, 8, (b,), generator=gen)
    images = protos[latent] + 0.5 * torch.randn(b, *IMAGE, generator=gen, dtype=spec.torch_dtype)
    tokens = (3 * latent[:, None] + torch.randint(0, 3, (b, spec.seq), generator=gen)) \
        % (spec.vocab - 1) + 1
    lengths = torch.randint(spec.seq // 2, spec.seq + 1, (b, 1), generator=gen)
    tokens = tokens.masked_fill(torch.arange(spec.seq) >= lengths, 0)
    return (images, tokens), torch.arange(b)
