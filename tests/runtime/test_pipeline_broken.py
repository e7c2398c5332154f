"""A step that fails part-way leaves transfers with the other ranks unmatched, so the pipeline
says so instead of pairing wrongly or waiting out another timeout: at 2 ranks (1F1B), inputs
the first layer cannot take (7 features for 6) fail the second step (the user's error on rank
0, a named PeerError on rank 1), and every later ``step`` and ``eval`` on both ranks raises at
once a RunError naming the rank and the first failure and telling to restart and resume from
the last checkpoint. Its own launch: the unmatched transfers must not reach another test's
part."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import FlexPipeError


def _said(call: Any) -> str:
    try:
        call()
    except (FlexPipeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def broken_main() -> dict[str, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=2, timeout_s=5)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    wide = torch.randn(4, 7, dtype=torch.float64)  # the first layer cannot take it

    def step(inputs: torch.Tensor) -> Any:
        return pipe.step(inputs if pipe.needs_inputs else None,
                         y if pipe.needs_targets else None)

    out = {"first": _said(lambda: step(x)), "failed": _said(lambda: step(wide)),
           "next": _said(lambda: step(x))}
    out["eval"] = _said(lambda: pipe.eval(x if pipe.needs_inputs else None))
    return out


@pytest.mark.timeout(600)
def test_a_step_failing_part_way_makes_every_later_call_say_why() -> None:
    said = flexpipe.spawn(broken_main, 2, timeout_s=120)
    assert [r["first"] for r in said] == ["returned", "returned"], said
    assert said[0]["failed"].startswith("RuntimeError: mat1 and mat2 shapes"), said
    assert said[1]["failed"].startswith("PeerError: "), said
    for rank, r in enumerate(said):
        for call in ("next", "eval"):
            text = r[call]
            assert text.startswith("RunError: this pipeline cannot run Pipeline."), (call, text)
            assert f"Pipeline.step failed on rank {rank}" in text, text
            assert "restart the processes and resume" in text, text
