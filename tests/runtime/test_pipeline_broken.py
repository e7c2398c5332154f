"""A step that fails part-way is one error on every rank, and what follows depends on whether
the ranks could reset their transfers. At 2 ranks (1F1B), inputs the first layer cannot take
(7 features for 6) fail the second step with the same ``RankError`` on both ranks, naming rank
0, its op, stage and micro-batch and the user's error; the transfers are reset, so the next
``step`` and ``eval`` run. When the reset cannot make the pipeline usable (as under FSDP or
tensor parallelism, whose collectives are left unmatched: here the worker says so), every
later ``step`` and ``eval`` on both ranks raises at once a RunError naming the first failure
and telling to restart and resume from the last checkpoint. Its own launch: a failure must
not reach another test's part."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import FlexPipeError
from flexpipe.runtime.execution.worker import RankWorker


def _said(call: Any) -> str:
    try:
        call()
    except (FlexPipeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "returned"


def _calls(pipe: Any, x: torch.Tensor, y: torch.Tensor, wide: torch.Tensor) -> dict[str, str]:
    def step(inputs: torch.Tensor) -> Any:
        return pipe.step(inputs if pipe.needs_inputs else None,
                         y if pipe.needs_targets else None)

    out = {"first": _said(lambda: step(x)), "failed": _said(lambda: step(wide)),
           "next": _said(lambda: step(x))}
    out["eval"] = _said(lambda: pipe.eval(x if pipe.needs_inputs else None))
    return out


def broken_main() -> dict[str, dict[str, str]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    wide = torch.randn(4, 7, dtype=torch.float64)  # the first layer cannot take it
    pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=2, timeout_s=300)
    out = {"reset": _calls(pipe, x, y, wide)}
    relink = RankWorker.relink
    RankWorker.relink = lambda self, ex: relink(self, ex) and False  # type: ignore[method-assign]
    try:
        pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=2, timeout_s=300)
        out["unusable"] = _calls(pipe, x, y, wide)
    finally:
        RankWorker.relink = relink  # type: ignore[method-assign]
    return out


@pytest.fixture(scope="module")
def said() -> list[dict[str, dict[str, str]]]:
    return flexpipe.spawn(broken_main, 2, timeout_s=120, deadline_s=240)


FAILED = ("RankError: Pipeline.step failed on rank 0 in op 0F0 (F of stage 0, micro-batch 0): "
          "RuntimeError: mat1 and mat2 shapes cannot be multiplied")


@pytest.mark.timeout(300)
def test_a_step_failing_part_way_is_one_error_and_the_next_call_runs(
        said: list[dict[str, dict[str, str]]]) -> None:
    for r in said:
        got = r["reset"]
        assert got["first"] == "returned" and got["failed"].startswith(FAILED), got
        assert "can run the next one" in got["failed"], got
        assert got["next"] == got["eval"] == "returned", got


@pytest.mark.timeout(300)
def test_a_pipeline_that_cannot_run_again_makes_every_later_call_say_why(
        said: list[dict[str, dict[str, str]]]) -> None:
    for r in said:
        got = r["unusable"]
        assert got["failed"].startswith(FAILED) and "cannot run again" in got["failed"], got
        for call in ("next", "eval"):
            text = got[call]
            assert text.startswith("RunError: this pipeline cannot run Pipeline."), (call, text)
            assert "Pipeline.step failed on rank 0 in op 0F0" in text, text
            assert "restart the processes and resume" in text, text
