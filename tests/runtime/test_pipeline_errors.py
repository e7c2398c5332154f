"""One rank's mistake is every rank's error: ``Pipeline.step`` and ``Pipeline.eval`` check each
rank's call and agree over the ranks before any message, so a bad call on one rank (a batch
that does not cut into m micro-batches, inputs where they are not read) raises the same
ConfigError on every rank, naming that rank and its reason; a user who catches it and goes on
finds every rank in step: the next call trains exactly like one device (no rank pairs with
another's next step). The ranks are the shared 2-process launch's (``shared_launch``)."""

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
from flexpipe.errors import ConfigError

M = 4
RTOL = 1e-12


def _data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(n, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 4, (n,), generator=gen))


def _said(call: Callable[[], Any]) -> str:
    """The ConfigError ``call`` raises ("accepted" when it raises none)."""
    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def rank_main() -> dict[str, Any]:
    """On one rank of 2: three bad calls (each wrong on one rank only, or on both), then a good
    step and eval; what each bad call said and the good step's errors against one device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    ref = copy.deepcopy(model)
    pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=M, timeout_s=20)
    x, y = _data(2 * M)
    first, last = pipe.needs_inputs, pipe.needs_targets
    said = {
        "short batch on rank 0": _said(lambda: pipe.step(x[:6] if first else None,
                                                         y if last else None)),
        "inputs on rank 1": _said(lambda: pipe.step(x, y if last else None)),
        "both wrong": _said(lambda: pipe.step(x[:6] if first else x, y if last else None)),
        "eval short on rank 0": _said(lambda: pipe.eval(x[:2] if first else None)),
    }
    loss = pipe.step(x if first else None, y if last else None)
    fn.cross_entropy(ref(x), y).backward()
    grads = dict(ref.named_parameters())
    err = {"grad": max(_rel(p.grad, grads[n].grad) for n, p in pipe.named_parameters())}
    if loss is not None:
        err["loss"] = _rel(loss, fn.cross_entropy(ref(x), y))
    out = pipe.eval(x if first else None)
    if out is not None:
        err["eval"] = _rel(out, ref(x))
    return {"said": said, "err": err, "rank": pipe.rank}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


shared_launch.register(2, "pipeline-errors", lambda: (rank_main, ()))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_bad_call_on_one_rank_raises_on_every_rank_and_the_next_step_is_exact() -> None:
    results = shared_launch.results(2, "pipeline-errors")
    said = [r["said"] for r in results]
    assert said[0] == said[1], said  # every rank raises the same error
    short = said[0]["short batch on rank 0"]
    assert short.startswith("Pipeline.step refused on every rank"), short
    assert "rank 0: inputs: a batch of 6 samples cannot be cut into the schedule's 4" in short
    assert "rank 1:" not in short
    extra = said[0]["inputs on rank 1"]
    assert "rank 1: inputs given on rank 1, which does not hold the first stage" in extra
    assert "rank 0:" not in extra
    both = said[0]["both wrong"]
    assert "rank 0: inputs: a batch of 6" in both and "rank 1: inputs given on rank 1" in both
    ev = said[0]["eval short on rank 0"]
    assert ev.startswith("Pipeline.eval refused") and "rank 0: inputs: a batch of 2" in ev
    # after the refused calls every rank is in step: the next step and eval equal one device
    assert {k for r in results for k in r["err"]} == {"grad", "loss", "eval"}
    assert all(v <= RTOL for r in results for v in r["err"].values()), results
