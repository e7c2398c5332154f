"""A model of your own for the command line (`flexpipe run --model examples.my_model:factory`):
a factory returns a `flexpipe.UserModel` -- the model (here a chain of layers, which
`--partition auto|params|2,1,1,2` cuts; any nn.Module with `split_points=(...)` works too), its
loss, an example micro-batch (inputs, target) and, optionally, `data(index)` giving micro-batch
`index` (without it, random tensors shaped like the example)."""
import torch
from torch import nn
from torch.nn import functional as F

import flexpipe


def batch(index: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index``: 8 tokens of 16 features; the class is the argmax of the mean."""
    x = torch.randn(size, 8, 16, generator=torch.Generator().manual_seed(index))
    return x, x.mean(dim=1)[:, :10].argmax(dim=1)


class Pool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(dim=1)


def factory() -> flexpipe.UserModel:
    """Called on every rank after torch.manual_seed(--seed)."""
    layers = nn.Sequential(
        nn.Linear(16, 32),
        *(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True) for _ in range(4)),
        Pool(), nn.Linear(32, 10))
    return flexpipe.UserModel(layers, F.cross_entropy, example=batch(0), data=batch)
