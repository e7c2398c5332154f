"""Your own model, your optimizer and data loader, pipelined over 2 processes with ZB-V:
    torchrun --nproc-per-node 2 examples/train_my_model.py
(or `python examples/train_my_model.py`, which starts the 2 processes itself)."""
import os

import torch
from torch import nn
from torch.nn import functional as F

import flexpipe


class Net(nn.Module):  # any nn.Module; `skip` crosses stage boundaries (a stage-graph edge)
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0,
                                                               batch_first=True) for _ in range(4))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = skip = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head((h + skip).mean(dim=1))


def loader(steps: int, batch: int = 16):  # your data: (inputs, targets) batches
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(batch, 8, 16, generator=gen)
        yield x, x.mean(dim=1)[:, :10].argmax(dim=1)


def main(steps: int = 30) -> None:
    torch.manual_seed(0)  # every rank builds the same initial weights
    pipe = flexpipe.pipeline(Net(), "zb-v", m=4, loss_fn=F.cross_entropy,
                             split_points=["blocks.1", "blocks.2", "blocks.3"])
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    data = loader(steps) if pipe.needs_inputs or pipe.needs_targets else [(None, None)] * steps
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
        opt.step()
        if loss is not None and step % 10 == 9:
            print(f"step {step + 1}: loss {loss.item():.4f}", flush=True)
    out = pipe.eval(x if pipe.needs_inputs else None)  # forward only
    if out is not None:
        print(f"accuracy on the last batch: {(out.argmax(dim=1) == y).float().mean():.2f}")
    pipe.close()


if __name__ == "__main__":
    main() if "RANK" in os.environ else flexpipe.spawn(main, 2)
