"""Seeded dropout of a traced model does not depend on where it is cut (issue 26): every random
operation of the traced graph draws from a generator keyed by its place in the model
(``flexpipe.runtime.user.randomness``), so parameters after 3 steps with dropout are the same
for any split points, schedule and rank count, and the same as the one-process pipeline of the
model (a world of 1), the reference. ``eval`` runs without dropout. The references run in the
shared one-process launch and the cut runs in the shared 2-process launch (``shared_launch``)."""

from __future__ import annotations

from typing import Any

import pytest
import shared_launch
import torch
import user_models as um
from torch.nn import functional as fn

import flexpipe

M, SEED = 4, 7
CASES: list[tuple[str, str, tuple[str, ...]]] = [
    ("drop", "1f1b", ("mid.1",)), ("drop", "zb-v", ("mid.0", "mid.1", "mid.2")),
    ("gpt2", "1f1b", ("lm.transformer.h.1",)),
    ("gpt2", "interleaved-1f1b", ("lm.transformer.h.1", "lm.transformer.h.2",
                                  "lm.transformer.h.3"))]
MODELS: dict[str, Any] = {"drop": (um.DropNet, um.vectors, fn.cross_entropy),
                          "gpt2": (um.gpt2_dropout, um.tokens, um.lm_loss)}


def train(name: str, schedule: str, points: tuple[str, ...]) -> dict[str, Any]:
    """3 steps with dropout (seeded); the final parameters of this rank and its eval output."""
    build, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build().double()
    pipe = flexpipe.pipeline(model, schedule, loss_fn=loss_fn, m=M, split_points=points,
                             seed=SEED, example=data(0, 2)[0])
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(3):
        x, y = data(step, 2 * M)
        opt.zero_grad()
        pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
        opt.step()
    x, _ = data(3, 2 * M)
    out = pipe.eval(x if pipe.needs_inputs else None)
    return {"params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "eval": out}


def rank_main(cases: list[tuple[str, str, tuple[str, ...]]]) -> list[dict[str, Any]]:
    return [train(*case) for case in cases]


def _merged(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {n: p for r in results for n, p in r["params"].items()}


def _reference_names() -> list[str]:
    """The models with a reference: the GPT-2 where transformers is installed."""
    return [name for name in MODELS if name != "gpt2" or um.installed("transformers")]


shared_launch.register(1, "traced-dropout", lambda: (
    rank_main, ([(name, "1f1b", ()) for name in [*_reference_names(), "drop"]],)))
if um.installed("transformers"):  # CASES cut the GPT-2 too
    shared_launch.register(2, "traced-dropout", lambda: (rank_main, (CASES,)))


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, Any]]:
    """The one-process runs (a world of 1), in the shared one-process launch: each model's
    reference, then the DropNet's again ("again")."""
    names = _reference_names()
    runs = shared_launch.results(1, "traced-dropout")[0]
    return {**dict(zip(names, runs[:-1], strict=True)), "again": runs[-1]}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_dropout_does_not_depend_on_the_cut(references: dict[str, dict[str, Any]]) -> None:
    pytest.importorskip("transformers")
    ranks = shared_launch.results(2, "traced-dropout")
    for i, (name, schedule, points) in enumerate(CASES):
        ref = references[name]["params"]
        got = _merged([r[i] for r in ranks])
        assert sorted(got) == sorted(ref), (name, schedule)
        worst = max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
        assert worst <= 1e-12, (name, schedule, points, worst)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_eval_runs_without_dropout(references: dict[str, dict[str, Any]]) -> None:
    """The reference's eval twice gives the same output (no dropout), and it equals the model
    in eval mode."""
    first = references["drop"]
    out = first["eval"]
    assert torch.equal(out, references["again"]["eval"])
    model = um.DropNet().double()
    model.load_state_dict(first["params"])
    model.eval()
    with torch.no_grad():
        want = model(um.vectors(3, 2 * M)[0])
    assert torch.allclose(out, want, rtol=1e-12, atol=0.0)
    model.train()  # the same inputs with dropout on give another output
    with torch.no_grad():
        assert not torch.allclose(model(um.vectors(3, 2 * M)[0]), want)
