"""``Pipeline.clip_grad_norm_`` where the gradients are DTensors: FSDP2's shards (ZeroPP's
AG/RS, pp 2 x dp 2) and tensor-parallel ones (pp 2 x tp 2, Megatron's split of the GPT's
blocks), against one process clipping the same batch with ``torch.nn.utils.clip_grad_norm_``.
The total norm (2 and infinity) is one process's on every rank, and after the clip the
gradients' norm is torch's clipped one (each shard scaled by the same factor). In the shared 4-rank
launch (``shared_launch``)."""

from __future__ import annotations

import math

import pytest
import shared_launch
import torch

import flexpipe
from flexpipe.runtime.models.gpt import TP_PLAN, GPTConfig, gpt_layers, lm_loss

CFG = GPTConfig(vocab=32, hidden=16, heads=4, layers=4, seq=8)
M, MAX_NORM = 4, 0.05
CASES = (("zeropp", 2, 1, 2.0), ("zeropp", 2, 1, math.inf), ("1f1b", 1, 2, 2.0),
         ("zb-h1", 1, 2, math.inf))
"""(schedule, dp, tp, norm)."""


def _model() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [layer.double() for layer in gpt_layers(CFG)]


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, CFG.vocab, (n, CFG.seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def clip_main() -> list[tuple[float, float]]:
    """Per case on this rank: the norm the clip returned, and the norm after it."""
    out = []
    for name, dp, tp, norm in CASES:
        extra = {"v": 2} if name == "zeropp" else {}
        pipe = flexpipe.pipeline(_model(), name, loss_fn=lm_loss, m=M, dp=dp, tp=tp,
                                 tp_plan=TP_PLAN if tp > 1 else None, **extra)
        x, y = _batch(2 * M * dp)
        mine_x, mine_y = x.chunk(dp)[pipe.replica], y.chunk(dp)[pipe.replica]
        pipe.step(mine_x if pipe.needs_inputs else None, mine_y if pipe.needs_targets else None)
        total = float(pipe.clip_grad_norm_(MAX_NORM, norm))
        after = float(pipe.clip_grad_norm_(1e300, norm))  # only measures: factor 1
        out.append((total, after))
    return out


shared_launch.register(4, "clip-sharded", lambda: (clip_main, ()))


def _reference(dp: int, norm: float) -> float:
    """One process: the replicas' micro-batches, each loss / (m x dp), then torch's clip."""
    model = torch.nn.Sequential(*_model())
    x, y = _batch(2 * M * dp)
    for xs, ys in zip(x.chunk(M * dp), y.chunk(M * dp), strict=True):
        (lm_loss(model(xs), ys) / (M * dp)).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_clipping_sharded_gradients_equals_one_process() -> None:
    results = shared_launch.results(4, "clip-sharded")
    for i, (name, dp, tp, norm) in enumerate(CASES):
        want = _reference(dp, norm)
        for rank, per_case in enumerate(results):
            total, after = per_case[i]
            assert total == pytest.approx(want, rel=1e-9), (name, dp, tp, norm, rank)
            clipped = want * min(1.0, MAX_NORM / (want + 1e-6))  # torch's factor
            assert after == pytest.approx(clipped, rel=1e-9), (name, dp, tp, norm, rank)
