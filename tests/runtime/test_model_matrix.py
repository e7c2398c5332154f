"""The models people train, exactly (issue 26): each model of ``matrix_models`` through the public
``flexpipe.pipeline`` API, with keyword inputs and the model's own loss (Hugging Face) or a
``loss_fn`` (the CNN), against plain one-process PyTorch training on the same micro-batches
(gradient accumulation, the same SGD): the loss of every step, every gradient, the parameters
and buffers (BatchNorm's running statistics) after 3 steps and the ``eval`` outputs agree to a
relative 1e-9 in float64.

CI runs the whole matrix at 2 ranks (every model x 1f1b, zb-h1, zb-v, interleaved-1f1b,
v-half, one launch: about a minute) and every model and every schedule at 4 ranks; the whole
matrix at 4 ranks is marked ``slow``: ``.venv/bin/pytest -m slow
tests/runtime/test_model_matrix.py`` (or ``benchmarks/model_matrix.py --p 4``)."""

from __future__ import annotations

import copy
from typing import Any

import matrix_models as mm
import pytest
import torch

import flexpipe
from flexpipe.schedules import registry

M, RTOL, STEPS = 4, 1e-9, 3
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "v-half")
CI_4 = [("gpt2-tied", "v-half"), ("llama", "interleaved-1f1b"), ("qwen2-tied", "1f1b"),
        ("bert-mask", "zb-v"), ("t5-shared", "zb-h1"), ("vit", "1f1b"), ("mixtral", "zb-v"),
        ("cnn-bn", "interleaved-1f1b")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    return float((a.detach() - b.detach()).norm() / max(float(b.detach().norm()), 1e-12))


def _stages(schedule: str, p: int) -> int:
    return registry.build(schedule, p, 2 * p).num_stages


def _slice(batch: dict[str, Any], j: int, n: int) -> dict[str, Any]:
    return {k: v[j * n:(j + 1) * n] for k, v in batch.items()}


def _ref_step(entry: mm.Entry, ref: torch.nn.Module, batch: mm.Batch, n: int) -> float:
    """One step of the reference: the micro-batches in order, gradients accumulated."""
    total = 0.0
    for j in range(M):
        inputs, target = mm.split_batch(entry, _slice(batch, j, n))
        out = ref(**inputs)
        loss = (out.loss if entry.loss_fn is None else entry.loss_fn(out, target)) / M
        loss.backward()
        total += loss.item()
    return total


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out["logits"]


def train_case(name: str, schedule: str, p: int) -> dict[str, float]:
    """On one rank: 3 pipelined steps next to the reference; the worst relative errors."""
    entry, stages = mm.MODELS[name], _stages(schedule, p)
    torch.manual_seed(0)
    model = entry.build(stages)
    ref = copy.deepcopy(model)
    buffers = {id(b): n for n, b in model.named_buffers()}
    example, _ = mm.split_batch(entry, entry.data(0, 2))
    pipe = flexpipe.pipeline(model, schedule, loss_fn=entry.loss_fn, m=M,
                             split_points=entry.points(stages), example=example)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "buffer": 0.0, "eval": 0.0}
    for step in range(STEPS):
        batch = entry.data(step, 2 * M)
        inputs, target = mm.split_batch(entry, batch)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(targets=target if pipe.needs_targets else None,
                         **(inputs if pipe.needs_inputs else {}))
        want = _ref_step(entry, ref, batch, 2)
        if loss is not None:
            errs["loss"] = max(errs["loss"], abs(float(loss) - want) / abs(want))
        grads = dict(ref.named_parameters())
        errs["grad"] = max([errs["grad"]] + [_rel(q.grad, grads[n].grad)
                                             for n, q in pipe.named_parameters()])
        opt.step()
        ref_opt.step()
    params, ref_bufs = dict(ref.named_parameters()), dict(ref.named_buffers())
    errs["param"] = max(_rel(q, params[n]) for n, q in pipe.named_parameters())
    errs["buffer"] = max([0.0] + [_rel(b, ref_bufs[buffers[id(b)]])
                                  for st in pipe.stages.values() for _, b in st.named_buffers()
                                  if id(b) in buffers])
    inputs, _ = mm.split_batch(entry, entry.data(STEPS, 2 * M))
    out = pipe.eval(**(inputs if pipe.needs_inputs else {}))
    if out is not None:
        ref.eval()
        with torch.no_grad():
            errs["eval"] = _rel(_logits(out), _logits(ref(**inputs)))
    return errs


def rank_main(cases: list[tuple[str, str]], p: int) -> list[dict[str, float]]:
    """Every case in turn on this rank (one process group for all of them)."""
    return [train_case(name, schedule, p) for name, schedule in cases]


def _check(cases: list[tuple[str, str]], p: int) -> None:
    results = flexpipe.spawn(rank_main, p, cases, p, timeout_s=120, deadline_s=1500)
    bad = {}
    for i, case in enumerate(cases):
        worst = {k: max(r[i][k] for r in results) for k in results[0][i]}
        if not all(v <= RTOL for v in worst.values()):
            bad[case] = worst
    assert not bad, bad


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")


@pytest.mark.timeout(900)
def test_every_model_and_schedule_at_two_ranks() -> None:
    _check([(name, s) for name in mm.MODELS for s in SCHEDULES], 2)


@pytest.mark.timeout(900)
def test_four_ranks() -> None:
    _check(CI_4, 4)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_full_matrix_at_four_ranks() -> None:
    _check([(name, s) for name in mm.MODELS for s in SCHEDULES], 4)


def test_four_ranks_cover_every_model_and_schedule() -> None:
    assert {n for n, _ in CI_4} == set(mm.MODELS)
    assert {s for _, s in CI_4} == set(SCHEDULES)


@pytest.mark.timeout(600)
def test_tied_weights_stay_one_under_data_parallel() -> None:
    """The tie's gradient is summed over the pipeline ranks of each replica, then averaged over
    the replicas like every other gradient."""
    assert max(flexpipe.spawn(mm.under_dp, 4, "gpt2-tied", "1f1b", 2, STEPS,
                              timeout_s=120)) <= RTOL
