"""Models whose forward a trace can miss: custom ``torch.autograd.Function``s (a scaled
gradient, a hand-written linear whose weight is a Function input, a clamp with a leaky
straight-through backward), ``torch.autocast`` regions (in a submodule, a decorated forward,
a region over the whole forward that spans every split point, with a float32 island inside),
and forwards that read ``self.training`` (stochastic depth, a train-only auxiliary head, train-
only input noise)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient by ``-scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.scale * g, None


class HandLinear(torch.autograd.Function):
    """``x @ w.T`` with its own backward (the weight's gradient halved, as a user might)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g @ w, 0.5 * (g.t() @ x)


class LeakyClamp(torch.autograd.Function):
    """Clamp to [-1, 1]; the backward passes the gradient inside, a tenth of it outside."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clamp(-1.0, 1.0)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.where(x.abs() <= 1.0, g, 0.1 * g)


class HandBlock(nn.Module):
    """A block that calls its Functions on its own weight."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LeakyClamp.apply(HandLinear.apply(x, self.weight))  # type: ignore[no-any-return]


class FunctionNet(nn.Module):
    """Linear, scaled-gradient, hand-written blocks, head: every Function in its own stage."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(HandBlock(8) for _ in range(3))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ScaleGrad.apply(torch.tanh(self.stem(x)), 0.5)
        if self.branch and h.shape[-1] == 8:  # a branch on a shape: torch.fx cannot trace it
            h = h * 1.0
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


class Half(nn.Module):
    """A block computing under bfloat16 autocast, with a float32 island inside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.a(x))
            with torch.autocast("cpu", enabled=False):
                h = h.float().softmax(-1) * 8
            return self.b(h)  # type: ignore[no-any-return]


class Decorated(nn.Module):
    """A block whose whole forward is decorated with autocast."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)

    @torch.autocast("cpu", dtype=torch.bfloat16)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x))


class AutocastNet(nn.Module):
    """Float32 stem, an autocast block, a decorated block, float32 head (``whole``: the whole
    forward under one autocast region as well, spanning every split point; ``branch``: a
    branch on a shape, so that it is exported)."""

    def __init__(self, whole: bool = False, branch: bool = False) -> None:
        super().__init__()
        self.whole, self.branch = whole, branch
        self.stem = nn.Linear(6, 8)
        self.amp = Half(8)
        self.deco = Decorated(8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.whole):
            h = self.deco(self.amp(self.stem(x)))
            if self.branch and h.shape[-1] == 8:
                h = h * 1.0
            h = self.mid(h.float())
        return self.head(h.float())  # type: ignore[no-any-return]


class Deep(nn.Module):
    """A residual block dropped at random in training (stochastic depth, a rescaled mask)."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.p, self.f = p, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x + self.f(x)
        keep = (torch.rand_like(x[:, :1]) >= self.p).to(x.dtype)
        return x + self.f(x) * keep / (1 - self.p)


class TrainingNet(nn.Module):
    """Input noise in training, stochastic-depth blocks, and an auxiliary head added to the
    output only in training."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(Deep(8, 0.25) for _ in range(3))
        self.aux = nn.Linear(8, 3)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        out = self.head(h)
        return out + 0.3 * self.aux(h) if self.training else out


@torch.library.custom_op("flexpipe_test::flip", mutates_args=())
def flip(x: torch.Tensor) -> torch.Tensor:
    """Identity forward, a negated gradient: a gradient reversal as a custom op."""
    return x.clone()


@flip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


flip.register_autograd(lambda ctx, g: -g)


class FlipNet(nn.Module):
    """Two linear layers around the custom-op gradient reversal; a branch on a shape, so that
    it is exported."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = flip(torch.tanh(self.a(x)))
        if h.shape[-1] == 8:
            h = h * 1.0
        return self.b(h)  # type: ignore[no-any-return]
