"""A micro-batch's loss must be a scalar floating-point tensor, and every rank learns at once
when one is not: at 2 ranks, under GPipe and ZB-H1 (the loss on rank 1), a ``loss_fn``
returning per-sample losses (``reduction="none"``), a 2 x 2 tensor, a Python float, an integer
tensor, or raising on the second micro-batch only, makes ``step`` raise the same ConfigError on
both ranks, naming the rank, stage, micro-batch and what the loss was; no rank returns
normally. A refusal at the first micro-batch adds no gradient, and the next good step's loss
and gradients equal one device's; so does a batch whose ``loss_items`` count 0 for every
micro-batch: loss 0, gradients 0. The ranks are the shared 2-process launch's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import shared_launch
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import FlexPipeError

M = 4
RTOL = 1e-12


def per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return fn.cross_entropy(out, y, reduction="none")


def square(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out[:, :2].T @ out[:, :2]


def python_float(out: torch.Tensor, y: torch.Tensor) -> float:
    return float(fn.cross_entropy(out, y))


def integer(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return out.argmax(dim=1).sum()


def second_fails(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if int(y[0]) == -1:
        raise KeyError("no such class")
    return fn.cross_entropy(out, y)


BAD: dict[str, Callable[..., Any]] = {"per_sample": per_sample, "square": square,
                                      "float": python_float, "integer": integer}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(2 * M, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (2 * M,), generator=gen))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def _step(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    return pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)


def _outcome(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> str:
    try:
        _step(pipe, x, y)
    except FlexPipeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def _grads(pipe: Any) -> list[float]:
    return [0.0 if p.grad is None else float(p.grad.abs().max()) for p in pipe.parameters()]


def checks_main(schedule: str) -> dict[str, Any]:
    """On one rank: each bad loss, what step did, the gradients left; then a good step and a
    step counting no items against one device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(model)
    x, y = _data()
    out: dict[str, Any] = {}
    for name, loss in BAD.items():
        torch.manual_seed(0)
        pipe = flexpipe.pipeline(copy.deepcopy(model), schedule, loss_fn=loss, m=M,
                                 timeout_s=60)
        out[name] = _outcome(pipe, x, y)
        out[name + ":grads"] = max(_grads(pipe))
    mixed = y.clone()
    mixed[2] = -1  # the second micro-batch's first target
    pipe = flexpipe.pipeline(copy.deepcopy(model), schedule, loss_fn=second_fails, m=M,
                             timeout_s=60)
    out["second"] = _outcome(pipe, x, mixed)
    for p in pipe.parameters():
        p.grad = None
    loss = _step(pipe, x, y)  # the same pipeline, in step again
    fn.cross_entropy(ref(x), y).backward()
    want = dict(ref.named_parameters())
    out["good:grad"] = max(_rel(p.grad, want[n].grad) for n, p in pipe.named_parameters())
    if loss is not None:
        out["good:loss"] = _rel(loss, fn.cross_entropy(ref(x), y).detach())
    counted = flexpipe.pipeline(copy.deepcopy(model), schedule, loss_fn=fn.cross_entropy, m=M,
                                timeout_s=60, loss_items=lambda t: (t != 7).sum())
    none = _step(counted, x, torch.full_like(y, 7))
    out["no items:loss"] = None if none is None else float(none)
    out["no items:grads"] = max(_grads(counted))
    return out


SCHEDULES = ("gpipe", "zb-h1")


def every_schedule() -> dict[str, dict[str, Any]]:
    return {s: checks_main(s) for s in SCHEDULES}


shared_launch.register(2, "loss-checks", lambda: (every_schedule, ()))


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return shared_launch.results(2, "loss-checks")


WHAT = {"per_sample": "is a tensor of shape (2,), not a scalar",
        "square": "is a tensor of shape (2, 2), not a scalar",
        "float": "is a float, not a tensor",
        "integer": "is a tensor of torch.int64, not of a floating-point type"}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_loss_is_one_error_on_every_rank(results: list[dict[str, Any]], schedule: str,
                                               name: str) -> None:
    said = [r[schedule][name] for r in results]
    assert said[0] == said[1], said  # the same decision on both ranks: none returns
    assert said[0].startswith("ConfigError: the step's loss was refused on every rank: "
                              "rank 1: the loss of stage 1, micro-batch 0 "), said[0]
    assert WHAT[name] in said[0] and "no gradient was added" in said[0], said[0]
    assert all(r[schedule][name + ":grads"] == 0.0 for r in results)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_loss_raising_later_is_named_and_the_next_step_is_exact(
        results: list[dict[str, Any]], schedule: str) -> None:
    said = [r[schedule]["second"] for r in results]
    assert said[0] == said[1], said
    assert "rank 1: the loss of stage 1, micro-batch 1 raised KeyError: 'no such class'" \
        in said[0], said[0]
    assert "zero them before the next step" in said[0], said[0]
    errors = [v for r in results for k, v in r[schedule].items() if k.startswith("good:")]
    assert len(errors) == 3 and max(errors) <= RTOL, results


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_batch_counting_no_items_has_loss_zero(results: list[dict[str, Any]],
                                                 schedule: str) -> None:
    losses = [r[schedule]["no items:loss"] for r in results]
    assert losses == [None, 0.0], losses
    assert all(r[schedule]["no items:grads"] == 0.0 for r in results)
