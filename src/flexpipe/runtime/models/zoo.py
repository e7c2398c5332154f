"""Built-in models and their data, by name: ``gpt`` (the small GPT on the synthetic text) and
``mlp`` (a two-stream MLP whose stage boundaries carry three tensors of different shapes and
dtypes, one of them integer, to exercise multi-tensor transfers); ``clip`` (two towers joined in
a contrastive loss, a graph model: ``flexpipe.runtime.models.graph``) draws its image and text
pairs here. Every rank builds the same model from the same seed and keeps its own stages."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.stage import Batch, LossFn
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


def build_model(spec: ModelSpec) -> tuple[list[nn.Module], LossFn]:
    """The model's layers (seeded, in ``spec.dtype``) and its loss."""
    torch.manual_seed(spec.seed)
    loss: LossFn
    layers: list[nn.Module]
    if spec.name == "gpt":
        layers, loss = gpt_layers(spec.gpt()), lm_loss
    elif spec.name == "mlp":
        d = spec.hidden
        layers = [Lift(d), *(TwoStream(d) for _ in range(spec.layers)),
                  Classify(d, spec.vocab, 8)]
        loss = fn.cross_entropy
    else:
        raise ConfigError(f"unknown built-in model {spec.name!r} (gpt, mlp)")
    return [layer.to(spec.torch_dtype) for layer in layers], loss


def make_batch(spec: ModelSpec, step: int, microbatches: int, replica: int = 0,
               replicas: int = 1) -> Batch:
    """Micro-batches of ``step`` for data-parallel ``replica`` (of ``replicas``): the
    replicas' batches together are the single-device batch of that step."""
    out: Batch = []
    for j in range(microbatches):
        index = (step * replicas + replica) * microbatches + j
        out.append(_sample(spec, index))
    return out


IMAGE = (3, 8, 8)
"""Shape of one ``clip`` image (channels, height, width)."""


def _sample(spec: ModelSpec, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    samplers = {"gpt": _text_sample, "mlp": _mlp_sample, "clip": _pair_sample,
                "gpt-vocab": _text_sample, "user": _user_sample}
    if spec.name not in samplers:
        raise ConfigError(f"unknown built-in model {spec.name!r} ({', '.join(samplers)})")
    return samplers[spec.name](spec, index)


def _text_sample(spec: ModelSpec, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x, y = TextData(spec.vocab, spec.seq, spec.seed).batch(index, spec.micro_batch)
    return (x,), y


def _mlp_sample(spec: ModelSpec, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed * 7919 + index)
    x = torch.randn(spec.micro_batch, spec.hidden, generator=gen, dtype=spec.torch_dtype)
    ids = torch.randint(0, 8, (spec.micro_batch,), generator=gen)
    y = torch.randint(0, spec.vocab, (spec.micro_batch,), generator=gen)
    return (x, ids), y


def _user_sample(spec: ModelSpec, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Your own model's micro-batch ``index`` (``flexpipe.runtime.user.model``)."""
    return spec_model(spec).sample(index, spec.seed)


def _pair_sample(spec: ModelSpec, index: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
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
