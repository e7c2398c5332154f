"""User models for the non-finite tests (``--model nan_models:NAME``): data holding an
infinity, a loss that turns NaN, and factories that build a different model (or other weights)
on each rank."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as fn


def _mlp(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 3))


def _with_inf(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 4)
    x[0, 1] = float("inf")
    return x, torch.tensor([0, 2])


def inf_data() -> object:
    """Training data holding an infinity."""
    from flexpipe.runtime.user.model import UserModel

    return UserModel(_mlp(), fn.cross_entropy, _with_inf(0), data=_with_inf)


def _nan_after_one_step(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = fn.cross_entropy(out, target)
    return torch.sqrt(loss - 1e6)  # NaN: the square root of a negative number


def nan_loss() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A loss that is NaN."""
    return _mlp(), (torch.randn(2, 4), torch.tensor([0, 2])), _nan_after_one_step


def per_rank_width() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A factory that builds a wider model on every rank (RANK, or the spawned process's)."""
    rank = int(os.environ.get("RANK", "0"))
    if torch.distributed.is_initialized():
        rank = torch.distributed.get_rank()
    return _mlp(8 + rank), (torch.randn(2, 4), torch.tensor([0, 2])), fn.cross_entropy


def per_rank_values() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], object]:
    """A factory that builds the same shapes on every rank, but a bias that holds the rank."""
    model = _mlp()
    if torch.distributed.is_initialized():
        with torch.no_grad():
            model[2].bias.add_(torch.distributed.get_rank())
    return model, (torch.randn(2, 4), torch.tensor([0, 2])), fn.cross_entropy
