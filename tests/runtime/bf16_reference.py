"""One process training under a mixed-precision policy by hand, without FlexPipe: what the bf16
tests compare a pipeline with. Each step takes a bfloat16 copy of the float32 masters (or the
masters themselves, ``fp32``), runs each replica's micro-batches in order, adds each one's
gradient into a float32 sum (bfloat16 with ``bf16_sums``, the sum FlexPipe does not do),
averages the replicas in float32 and steps SGD on the masters."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

ForwardLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""(the compute copy, a micro-batch's inputs, its targets) -> its loss."""


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return float((a - b).norm() / b.norm())


def policy_step(master: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], replicas: int,
                m: int, lr: float, forward_loss: ForwardLoss, fp32: bool = False,
                bf16_sums: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One SGD step of ``master`` on ``batch`` (``replicas`` x ``m`` micro-batches): the
    gradients (float32, averaged over the replicas) and each replica's loss."""
    low = master if fp32 else copy.deepcopy(master).to(torch.bfloat16)
    sums: list[dict[str, torch.Tensor]] = []
    losses = []
    x, y = batch
    for xr, yr in zip(x.chunk(replicas), y.chunk(replicas), strict=True):
        acc = {n: torch.zeros_like(p, dtype=torch.bfloat16 if bf16_sums else None)
               for n, p in master.named_parameters()}
        total = 0.0
        for xm, ym in zip(xr.chunk(m), yr.chunk(m), strict=True):
            low.zero_grad(set_to_none=True)
            loss = forward_loss(low, xm, ym) / m
            loss.backward()
            total += float(loss.detach().double())
            for n, p in low.named_parameters():
                if p.grad is not None:  # an expert no token reached
                    acc[n] += p.grad
        sums.append(acc)
        losses.append(total)
    grads = {n: _total([s[n].float() for s in sums]) / replicas for n in sums[0]}
    with torch.no_grad():
        for n, p in master.named_parameters():
            p -= lr * grads[n]
    return grads, losses


def _total(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts added in order (the replicas' sum, as one process adds them)."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out
