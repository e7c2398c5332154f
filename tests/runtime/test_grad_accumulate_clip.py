"""Gradients over several ``Pipeline.step`` calls and their clipping, against one process: a
tiny Hugging Face GPT-2 whose output head is its input embedding (float64) accumulates two
steps without zeroing, then ``pipe.clip_grad_norm_`` clips the whole model's gradient. Under
1F1B the tie spans the two ranks (the embedding on rank 0, the head on rank 1), under ZB-V it
sits on rank 0 (stages 0 and 3). Every gradient equals one process's accumulated and clipped by
``torch.nn.utils.clip_grad_norm_`` (relative error <= 1e-9), and the returned norm is the
whole model's on both ranks. Runs in the shared 2-process launch (``shared_launch``)."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
import shared_launch
import torch
import user_models as um

import flexpipe

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")
from test_pipeline_state import gpt2_tied  # noqa: E402 - needs transformers

M, STEPS, MAX_NORM = 2, 2, 0.05
H = "lm.transformer.h."
CASES = {"1f1b": (H + "2",), "zb-v": (H + "1", H + "2", H + "3")}
NORMS = (2.0, math.inf)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [um.tokens(step, 2 * M) for step in range(STEPS)]


def accumulate_main() -> dict[str, Any]:
    """Per schedule and norm: this rank's gradients after two steps and after the clip, and the
    norm the clip returned."""
    out: dict[str, Any] = {}
    for name, points in CASES.items():
        for norm in NORMS:
            torch.manual_seed(0)
            pipe = flexpipe.pipeline(gpt2_tied(), name, loss_fn=um.lm_loss, m=M,
                                     split_points=points, example=um.tokens(0, 2)[0])
            for x, y in _batches():
                pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
            grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}
            total = pipe.clip_grad_norm_(MAX_NORM, norm)
            clipped = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}
            out[f"{name}:{norm}"] = (grads, float(total), clipped)
    return out


shared_launch.register(2, "accumulate-clip", lambda: (accumulate_main, ()))


@cache
def reference(norm: float) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
    """One process: the same micro-batches, loss / m each, two steps accumulated, then
    ``torch.nn.utils.clip_grad_norm_``."""
    torch.manual_seed(0)
    model = gpt2_tied()
    for x, y in _batches():
        for xj, yj in zip(x.chunk(M), y.chunk(M), strict=True):
            (um.lm_loss(model(xj), yj) / M).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm))
    return grads, total, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return shared_launch.results(2, "accumulate-clip")


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("name", list(CASES))
def test_accumulated_and_clipped_gradients_equal_one_process(
        ranks: list[dict[str, Any]], name: str, norm: float) -> None:
    want_grads, want_total, want_clipped = reference(norm)
    seen: set[str] = set()
    for got in ranks:
        grads, total, clipped = got[f"{name}:{norm}"]
        assert total == pytest.approx(want_total, rel=1e-9)
        for n, g in grads.items():
            assert _rel(g, want_grads[n]) <= 1e-9, (n, "accumulated")
            assert _rel(clipped[n], want_clipped[n]) <= 1e-9, (n, "clipped")
        seen |= set(grads)
    assert seen == set(want_grads)  # every parameter is on some rank (the tie under one name)
    assert want_total > MAX_NORM  # the clip scaled them
