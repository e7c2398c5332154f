"""Built-in models as graphs of layer sequences (``Segment``s): ``clip`` is a two-tower
(CLIP-like) model -- an image tower (patch embedding, residual MLP blocks, pooling) and a text
tower (token embedding, transformer blocks, masked pooling) joined in a stage that projects
both, and a symmetric contrastive (InfoNCE) loss over the micro-batch's similarity matrix.

The contrastive loss couples the samples of a micro-batch only: each micro-batch's loss is
divided by m like any other, and the single-process reference computes the same sum.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.execution.stage import LossFn
from flexpipe.runtime.models.gpt import Block
from flexpipe.runtime.models.spec import ModelSpec, seeded_segments
from flexpipe.runtime.models.zoo import IMAGE

PATCH = 4
"""Side of an image patch (pixels)."""


class PatchEmbed(nn.Module):
    """Images (b, c, H, W) -> patch features (b, patches, h)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.lin = nn.Linear(IMAGE[0] * PATCH * PATCH, hidden)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Cut into patches, embed each."""
        b, c, hh, ww = images.shape
        x = images.reshape(b, c, hh // PATCH, PATCH, ww // PATCH, PATCH)
        x = x.permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * PATCH * PATCH)
        return self.lin(x)  # type: ignore[no-any-return]


class MLPBlock(nn.Module):
    """Pre-norm residual MLP on patch features."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block."""
        return x + self.down(fn.gelu(self.up(self.norm(x))))  # type: ignore[no-any-return]


class MeanPool(nn.Module):
    """Patch features -> one normalised feature per image."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Average the patches."""
        return self.norm(x).mean(dim=1)  # type: ignore[no-any-return]


class TokenEmbed(nn.Module):
    """Token ids (b, s) -> (hidden states, ids): the ids travel on for the pooling mask."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embed."""
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(pos), ids


class TextBlock(nn.Module):
    """A transformer block on (hidden states, ids), passing the ids along (a stage boundary
    inside the text tower carries two tensors, one of them integer)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.block = Block(spec.gpt())

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One block."""
        return self.block(h), ids


class MaskedPool(nn.Module):
    """(hidden states, ids) -> one feature per caption: the mean over non-padding tokens."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Average the real tokens (id 0 is padding)."""
        keep = (ids != 0).to(h.dtype)[..., None]
        return (self.norm(h) * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


class Contrast(nn.Module):
    """(image feature, text feature) -> similarity logits (b, b) of the micro-batch."""

    def __init__(self, hidden: int, embed: int) -> None:
        super().__init__()
        self.image, self.text = nn.Linear(hidden, embed), nn.Linear(hidden, embed)
        self.log_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        """Scaled cosine similarities."""
        a = fn.normalize(self.image(img), dim=-1)
        b = fn.normalize(self.text(txt), dim=-1)
        return self.log_scale.exp() * a @ b.T


def contrastive_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE: cross-entropy of images over captions and captions over images
    (``target[i]`` = the caption of image i), averaged."""
    return (fn.cross_entropy(logits, target) + fn.cross_entropy(logits.T, target)) / 2


def clip_segments(spec: ModelSpec) -> list[Segment]:
    """The two towers (``image`` reads batch input 0, ``text`` input 1) and the ``join``."""
    h = spec.hidden
    image = [PatchEmbed(h), *(MLPBlock(h) for _ in range(spec.layers)), MeanPool(h)]
    text = [TokenEmbed(spec.vocab, h, spec.seq),
            *(TextBlock(spec) for _ in range(spec.layers)), MaskedPool(h)]
    return [Segment("image", tuple(image), feeds=(0,)),
            Segment("text", tuple(text), feeds=(1,)),
            Segment("join", (Contrast(h, h),), after=("image", "text"))]


def clip_model(spec: ModelSpec) -> tuple[list[Segment], LossFn]:
    """The two-tower model's segments (seeded, in ``spec.dtype``) and its contrastive loss."""
    return seeded_segments(spec, clip_segments), contrastive_loss
