"""The models people train, exactly : each model of ``matrix_models`` through the public
``flexpipe.pipeline`` API, with keyword inputs and the model's own loss (Hugging Face) or a
``loss_fn`` (the CNN), against plain one-process PyTorch training on the same micro-batches
(gradient accumulation, the same SGD): the loss of every step, every gradient, the parameters
and buffers (BatchNorm's running statistics) after 3 steps and the ``eval`` outputs agree to a
relative 1e-9 in float64.

CI runs every model and every schedule at 2 ranks (``CI_2``) and the tied GPT-2, whose tie
crosses the middle ranks, at 4 (``CI_4``, each under another schedule than at 2 ranks; the tied
weights under data parallelism ride along), each in the shared launch of its world size
(``shared_launch``, where transformers is installed); ``SLOW_4`` runs the other schedules at 4.
The whole matrix (every model x 1f1b, zb-h1, zb-v, interleaved-1f1b, v-half) at 2 and at 4
ranks is marked ``slow``: ``.venv/bin/pytest -m slow tests/runtime/test_model_matrix.py`` (or
``benchmarks/model_matrix.py --p 4``)."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import matrix_models as mm
import pytest
import shared_launch
import torch

import flexpipe
from flexpipe.schedules import registry

M, RTOL, STEPS = 4, 1e-9, 3
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "v-half")
CI_2 = [("gpt2-tied", "1f1b"), ("llama", "zb-v"), ("qwen2-tied", "v-half"),
        ("bert-mask", "interleaved-1f1b"), ("t5-shared", "v-half"), ("vit", "zb-v"),
        ("mixtral", "zb-h1"), ("cnn-bn", "zb-h1")]
"""Every model once at 2 ranks: a tie across the ranks (GPT-2, 1F1B) and within rank 0
(Qwen2 and T5 under V-Half: the V puts the first and the last stage there)."""
CI_4 = [("gpt2-tied", "v-half")]
"""At 4 ranks in CI, state that crosses middle ranks: tied embeddings over 4 ranks, on a V."""
SLOW_4 = [("t5-shared", "zb-h1"), ("qwen2-tied", "1f1b"), ("bert-mask", "zb-v"),
          ("cnn-bn", "interleaved-1f1b")]
"""With ``CI_4``, every schedule once at 4 ranks (``slow``): T5's shared embedding between
encoder and decoder, BERT's attention mask, the CNN's BatchNorm buffers and its residual over
every stage (each model and schedule runs at 2 ranks in CI)."""


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


def rank_main(cases: list[tuple[str, str]], p: int, tied_dp: bool = False) -> list[Any]:
    """Every case in turn on this rank (one process group for all of them); with ``tied_dp``
    (4 ranks) then the tied model at pp 2 x dp 2 (``matrix_models.under_dp``)."""
    out: list[Any] = [train_case(name, schedule, p) for name, schedule in cases]
    if tied_dp:
        out.append(mm.under_dp("gpt2-tied", "1f1b", 2, STEPS))
    return out


def _spawn(cases: list[tuple[str, str]], p: int, tied_dp: bool = False) -> list[list[Any]]:
    return flexpipe.spawn(rank_main, p, cases, p, tied_dp, timeout_s=120, deadline_s=1500)


HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
if HAS_TRANSFORMERS:  # otherwise every test here skips: the shared launches run without them
    shared_launch.register(2, "model-matrix", lambda: (rank_main, (CI_2, 2)))
    shared_launch.register(4, "model-matrix", lambda: (rank_main, (CI_4, 4, True)))


def _check(cases: list[tuple[str, str]], results: list[list[Any]]) -> None:
    bad = {}
    for i, case in enumerate(cases):
        worst = {k: max(r[i][k] for r in results) for k in results[0][i]}
        if not all(v <= RTOL for v in worst.values()):
            bad[case] = worst
    assert not bad, bad


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")


@pytest.fixture(scope="module")
def four_ranks() -> list[list[Any]]:
    """The shared 4-rank launch's part: ``CI_4``, then the tied weights under data
    parallelism."""
    pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")
    return shared_launch.results(4, "model-matrix")


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_every_model_and_schedule_at_two_ranks() -> None:
    """``CI_2`` in the shared 2-rank launch: every model, every schedule."""
    _check(CI_2, shared_launch.results(2, "model-matrix"))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_four_ranks(four_ranks: list[list[Any]]) -> None:
    """``CI_4`` at 4 ranks."""
    _check(CI_4, [r[:len(CI_4)] for r in four_ranks])


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("p", [2, 4])
def test_the_full_matrix(p: int) -> None:
    cases = [(name, s) for name in mm.MODELS for s in SCHEDULES]
    _check(cases, _spawn(cases, p))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_four_ranks_under_the_other_schedules() -> None:
    """``SLOW_4`` in a 4-rank launch of its own."""
    _check(SLOW_4, _spawn(SLOW_4, 4))


def test_ci_covers_every_model_and_schedule() -> None:
    assert sorted(n for n, _ in CI_2) == sorted(mm.MODELS)  # each model once at 2 ranks
    for cases in (CI_2, CI_4 + SLOW_4):
        assert {s for _, s in cases} == set(SCHEDULES)
        assert len({n for n, _ in cases}) == len(cases)
    assert not set(CI_2) & set(CI_4 + SLOW_4)  # a model at 4 ranks runs another schedule


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_tied_weights_stay_one_under_data_parallel(four_ranks: list[list[Any]]) -> None:
    """The tie's gradient is summed over the pipeline ranks of each replica, then averaged over
    the replicas like every other gradient."""
    assert max(r[len(CI_4)] for r in four_ranks) <= RTOL
