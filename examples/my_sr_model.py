"""A model of your own under selective recompute (`flexpipe run --model examples.my_sr_model:factory`):
an embedding, four blocks of attention and an MLP, and a head, cut into 4 stages.
`Recompute(drop=MLP)` makes each MLP a region that a forward marked SR drops and SR recomputes
before the backward; a profile (`flexpipe run ... --predict --cost-out FILE`) measures what such
a forward keeps (`sr_act`, `sr_act_w`) and SR's time, and `flexpipe search --cost FILE` trades
that recompute for memory where the limit is tight (examples/sr_profile.json, docs/search.md)."""
import torch
from torch import nn
from torch.nn import functional as F

import flexpipe


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, 4, batch_first=True)
        self.mlp = MLP(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self, h: int = 128) -> None:
        super().__init__()
        self.embed = nn.Linear(16, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(4))
        self.head = nn.Linear(h, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def batch(index: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index``: 64 tokens of 16 features; the class is the argmax of the mean."""
    x = torch.randn(size, 64, 16, generator=torch.Generator().manual_seed(index))
    return x, x.mean(dim=1)[:, :10].argmax(dim=1)


def factory() -> flexpipe.UserModel:
    """Called on every rank after torch.manual_seed(--seed)."""
    return flexpipe.UserModel(Net(), F.cross_entropy, example=batch(0), data=batch,
                              split_points=("blocks.1", "blocks.2", "blocks.3"),
                              recompute=flexpipe.Recompute(drop=MLP))
