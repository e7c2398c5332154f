"""A loss that averages over counted tokens (labels of -100 skipped, as Hugging Face's LMs
count them): with ``loss_items`` each micro-batch weighs its share of the batch's tokens, so
the gradients and the loss are one device's on the whole batch, under any schedule, with
data-parallel replicas holding different counts, and with a micro-batch that counts nothing.
Without it (every micro-batch 1 / m) the gradients differ wherever the counts do."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import shared_launch
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import ConfigError

VOCAB, SEQ, M = 11, 6, 4


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, VOCAB)).double()


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fn.cross_entropy(logits.flatten(0, 1), target.flatten())  # mean, -100 skipped


def _items(target: torch.Tensor) -> torch.Tensor:
    return (target != -100).sum()


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample i has its first (i * 5) % SEQ labels padded; samples 4 and 5 (micro-batch 2 of
    4 for n = 8) have none counted."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    target = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    for i in range(n):
        target[i, :(i * 5) % SEQ] = -100
    target[4:6] = -100
    return ids, target


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-300))


def train(schedule: str, dp: int, counted: bool) -> dict[str, float]:
    """One step on this rank against one device on the whole batch: the worst gradient
    error, and the loss's error against this replica's token mean."""
    model = _model()
    ref = copy.deepcopy(model)
    pipe = flexpipe.pipeline(model, schedule, loss_fn=_loss, m=M, dp=dp,
                             loss_items=_items if counted else None)
    x, y = _batch(2 * M * dp)
    mine_x, mine_y = x.chunk(dp)[pipe.replica], y.chunk(dp)[pipe.replica]
    loss = pipe.step(mine_x if pipe.needs_inputs else None, mine_y if pipe.needs_targets else None)
    _loss(ref(x), y).backward()
    want = dict(ref.named_parameters())
    out = {"grad": max(_rel(p.grad, want[n].grad) for n, p in pipe.named_parameters())}
    if loss is not None:
        with torch.no_grad():
            out["loss"] = abs(float(loss) - float(_loss(ref(mine_x), mine_y)))
    return out


CASES_2 = [("zb-h1", 1, True), ("1f1b", 1, True), ("zb-v", 1, True), ("1f1b", 1, False)]
CASES_4 = [("zb-h1", 2, True), ("1f1b", 2, False)]


def _run(cases: list[tuple[str, int, bool]]) -> list[dict[str, float]]:
    return [train(*case) for case in cases]


shared_launch.register(2, "token-mean", lambda: (_run, (CASES_2,)))
shared_launch.register(4, "token-mean", lambda: (_run, (CASES_4,)))


def _worst(world: int, cases: list[Any]) -> list[dict[str, float]]:
    results = shared_launch.results(world, "token-mean")
    return [{k: max(r[i].get(k, 0.0) for r in results) for k in ("grad", "loss")}
            for i in range(len(cases))]


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_counted_tokens_train_like_one_device() -> None:
    got = _worst(2, CASES_2) + _worst(4, CASES_4)
    for case, errs in zip(CASES_2 + CASES_4, got, strict=True):
        if case[2]:
            assert errs["grad"] <= 1e-12 and errs["loss"] <= 1e-12, (case, errs)
        else:  # every micro-batch 1 / m: not one device's token mean
            assert errs["grad"] > 1e-2, (case, errs)


def test_a_bad_count_is_named() -> None:
    from flexpipe.runtime.pipeline import items

    with pytest.raises(ConfigError, match=r"loss_items\(target of micro-batch 1\) returned "
                                          r"tensor\(\[1, 2\]\)"):
        items.counts(lambda t: t, [torch.tensor(3), torch.tensor([1, 2])])
    with pytest.raises(ConfigError, match="returned -1"):
        items.counts(lambda t: -1, [None])
