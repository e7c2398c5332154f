"""Stages built from a model given as a sequence of layers and a partition (layers per stage).

A layer takes the tensors the previous one returned (a tuple is spread over its arguments) and
returns a tensor or a tuple of tensors; a stage boundary may therefore carry several tensors of
any shape and dtype. The first stage takes the inputs, the last one's output goes to the loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flexpipe.errors import ConfigError

Tensors = tuple[torch.Tensor, ...]


def as_tuple(x: torch.Tensor | Sequence[torch.Tensor]) -> Tensors:
    """A layer's result as a tuple of tensors."""
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


class StageModule(nn.Module):
    """Consecutive layers ``first .. first + len(layers) - 1`` of the model."""

    def __init__(self, layers: Sequence[nn.Module], first: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first

    def forward(self, *inputs: torch.Tensor) -> Tensors:  # type: ignore[override]
        """Run the layers in turn."""
        x: Tensors = tuple(inputs)
        for layer in self.layers:
            x = as_tuple(layer(*x))
        return x

    def named_global_parameters(self) -> dict[str, torch.Tensor]:
        """Parameters named by their layer index in the whole model, e.g. ``3.qkv.weight``."""
        return {f"{self.first + int(name.split('.')[1])}.{name.split('.', 2)[2]}": p
                for name, p in self.named_parameters()}


def even_partition(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible (earlier stages get the extra layers)."""
    if num_layers < num_stages:
        raise ConfigError(f"the model has {num_layers} layers, fewer than the {num_stages} "
                          f"stages of the schedule; use a deeper model or fewer stages")
    q, r = divmod(num_layers, num_stages)
    return [q + (1 if s < r else 0) for s in range(num_stages)]


def build_stages(layers: Sequence[nn.Module], partition: Sequence[int] | None,
                 num_stages: int, keep: Sequence[int] | None = None) -> dict[int, StageModule]:
    """Stage modules (only the stages in ``keep``, default all) for a partition given as
    layers per stage (None: even)."""
    parts = list(partition) if partition is not None else even_partition(len(layers), num_stages)
    if len(parts) != num_stages or any(n < 1 for n in parts) or sum(parts) != len(layers):
        raise ConfigError(f"partition {parts} must give each of the {num_stages} stages at least "
                          f"one layer and cover all {len(layers)} layers")
    starts = [sum(parts[:s]) for s in range(num_stages)]
    wanted = range(num_stages) if keep is None else keep
    return {s: StageModule(layers[starts[s]:starts[s] + parts[s]], starts[s]) for s in wanted}
