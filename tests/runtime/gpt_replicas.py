"""A float64 built-in GPT as a chain of layers trained over data-parallel replicas, and the same
training on one process: what the FSDP/HSDP tests compare a pipeline with. Every rank and the
reference build the same seeded layers and read the same batches."""

from __future__ import annotations

import torch

from flexpipe.runtime.models.gpt import GPTConfig, gpt_layers, lm_loss

Full = dict[str, torch.Tensor]


def layers(cfg: GPTConfig) -> list[torch.nn.Module]:
    """The GPT's layers, seeded, in float64."""
    torch.manual_seed(0)
    return [layer.double() for layer in gpt_layers(cfg)]


def batch(cfg: GPTConfig, step: int, dp: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``: ``dp`` replicas' ``m`` micro-batches of 2 sequences."""
    ids = torch.randint(0, cfg.vocab, (2 * m * dp, cfg.seq + 1),
                        generator=torch.Generator().manual_seed(10 + step))
    return ids[:, :-1], ids[:, 1:]


def one_process(cfg: GPTConfig, steps: int, dp: int, m: int,
                lr: float) -> tuple[list[list[float]], Full]:
    """One process on the whole batch of ``dp`` replicas (SGD at ``lr``): per step each
    replica's mean loss (what its pipeline returns), and the parameters after ``steps``."""
    model = torch.nn.Sequential(*layers(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(cfg, step, dp, m)
        opt.zero_grad()
        per_replica = [0.0] * dp
        for j, (xs, ys) in enumerate(zip(x.chunk(m * dp), y.chunk(m * dp), strict=True)):
            loss = lm_loss(model(xs), ys)
            (loss / (m * dp)).backward()
            per_replica[j // m] += float(loss.detach()) / m
        opt.step()
        losses.append(per_replica)
    return losses, {n: p.detach() for n, p in model.named_parameters()}
