"""A loss that averages over counted tokens (labels of -100 skipped, as Hugging Face's LMs
count them): with ``loss_items`` each micro-batch weighs its share of the batch's tokens, so
the gradients and the loss are one device's on the whole batch, under any schedule, with
data-parallel replicas holding different counts, with a micro-batch that counts nothing, and
for a Hugging Face GPT-2 computing its own loss from its ``labels`` (counted on the first
stage, weighed on the last). Without it (every micro-batch 1 / m) the gradients differ
wherever the counts do."""

from __future__ import annotations

import copy
import importlib.util
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


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-300) -> float:
    return float((a - b).norm() / max(float(b.norm()), floor))


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


def own_loss(schedule: str) -> dict[str, float]:
    """A Hugging Face GPT-2 computing its own loss from ``labels`` (padded as ``_batch``
    pads them), against the same model on the whole batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=8, n_layer=4, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg).double()
    ref = copy.deepcopy(model)
    x, y = _batch(2 * M)
    points = ["transformer.h.2"] if schedule == "zb-h1" else \
        ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    pipe = flexpipe.pipeline(model, schedule, m=M, split_points=points,
                             example={"input_ids": x[:2], "labels": y[:2]},
                             loss_items=lambda labels: (labels[:, 1:] != -100).sum())
    named = {"input_ids": x, "labels": y} if pipe.needs_inputs else {}
    loss = pipe.step(**named)
    ref(input_ids=x, labels=y).loss.backward()
    want = dict(ref.named_parameters())
    floor = 1e-6 * float(torch.cat([p.grad.flatten() for p in ref.parameters()]).norm())
    out = {"grad": max(_rel(p.grad, want[n].grad, floor)  # the key bias's is 0 but rounding
                       for n, p in pipe.named_parameters())}
    if loss is not None:
        with torch.no_grad():
            out["loss"] = abs(float(loss) - float(ref(input_ids=x, labels=y).loss))
    return out


CASES_2 = [("zb-h1", 1, True), ("1f1b", 1, True), ("zb-v", 1, True), ("1f1b", 1, False)]
CASES_4 = [("zb-h1", 2, True), ("1f1b", 2, False)]
OWN = ("zb-h1", "zb-v") if importlib.util.find_spec("transformers") else ()
"""The schedules the Hugging Face model's own loss trains under (with transformers)."""


def _run(cases: list[tuple[str, int, bool]], own: tuple[str, ...] = ()
         ) -> list[dict[str, float]]:
    return [train(*case) for case in cases] + [own_loss(s) for s in own]


shared_launch.register(2, "token-mean", lambda: (_run, (CASES_2, OWN)))
shared_launch.register(4, "token-mean", lambda: (_run, (CASES_4,)))


def _worst(world: int, cases: list[Any]) -> list[dict[str, float]]:
    results = shared_launch.results(world, "token-mean")
    return [{k: max((r[i][k] for r in results if k in r[i]), default=0.0,
                    key=lambda v: (v != v, v))  # a NaN counts as the worst
             for k in ("grad", "loss")} for i in range(len(cases))]


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_counted_tokens_train_like_one_device() -> None:
    own = [(s, 1, True) for s in OWN]
    got = _worst(2, CASES_2 + own) + _worst(4, CASES_4)
    cases = [(c, False) for c in CASES_2] + [(c, True) for c in own] + \
        [(c, False) for c in CASES_4]
    for (case, hf), errs in zip(cases, got, strict=True):
        if hf:  # Hugging Face computes its loss in float32 (logits.float())
            assert errs["grad"] <= 1e-6 and errs["loss"] <= 1e-6, (case, errs)
        elif case[2]:
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
