"""The eager path (``flexpipe.runtime.user.eager``, ``hf_eager``, ``hf_seq2seq``): models cut
into stages that run the model's own forward train like one process in float64 (loss and
every gradient within 1e-10), at 2 ranks in one shared launch: a model with data-dependent
control flow in its blocks and a tiny Qwen2-MoE returning its router logits (its auxiliary
loss over every layer's) under 1F1B, ZB-H1 (2 stages) and ZB-V (4 stages on 2 ranks); Llama
and GPT-2 with tied embeddings (the tie across ranks), Mixtral with its router logits, T5 and
BART (encoder and decoder blocks on different stages) under one schedule each, every other
schedule in the ``slow`` run. W is deferred for the branching model's linear layers. In this
process: the stages in turn give the model's output and gradients, and a cut whose forward
does not pass its state along is refused by name."""

from __future__ import annotations

import copy
from typing import Any

import eager_models as em
import pytest
import shared_launch
import torch

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.runtime.user.eager import eager_stages

M = em.M
TOL = 1e-10
"""Relative error of the loss and of every gradient (float64; a Hugging Face model computes
its language-model loss in float32, the pipeline's loss is that same float32 number)."""


def _reference(model: torch.nn.Module, loss_fn: Any, xs: tuple[torch.Tensor, ...],
               y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One process, micro-batch by micro-batch, each weighing 1 / M (the losses summed in
    float64, as the pipeline sums them)."""
    ref = copy.deepcopy(model)
    if hasattr(ref, "config"):
        total = sum(ref(*(t.chunk(M)[i] for t in xs), labels=y.chunk(M)[i]).loss.double()
                    for i in range(M)) / M
    else:
        total = sum(loss_fn(ref(*(t.chunk(M)[i] for t in xs)), y.chunk(M)[i])
                    for i in range(M)) / M
    total.backward()
    return total.detach(), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def train(name: str, schedule: str) -> float:
    """On one rank: one pipelined step next to one process's; the worst relative error."""
    torch.manual_seed(0)
    model, stages, loss_fn, xs, y = em.CASES[name](em.POINTS[name][schedule])
    want_loss, want = _reference(model, loss_fn, xs, y)
    pipe = flexpipe.pipeline(stages, schedule, loss_fn=loss_fn, m=M)
    loss = pipe.step(xs if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    errs = [float((p.grad - want[n]).norm() / want[n].norm().clamp_min(1e-30))
            for n, p in pipe.named_parameters() if n in want]
    unused = [p for n, p in pipe.named_parameters() if n not in want]  # a branch not taken
    assert all(p.grad is None or not p.grad.any() for p in unused)
    if loss is not None:
        errs.append(abs(float(loss) - float(want_loss)) / abs(float(want_loss)))
    return max(errs)


SCHEDULES = ("1f1b", "zb-h1", "zb-v")
ONE = {"llama-tied": "1f1b", "gpt2": "zb-h1", "mixtral": "zb-v", "t5": "1f1b", "bart": "zb-v"}
"""The schedule each model trains under in the default run (the tied ones across ranks)."""
MATRIX = [(n, s) for n in ("branchy", "qwen2-moe") for s in SCHEDULES] + list(ONE.items())
SLOW = [(n, s) for n in ONE for s in SCHEDULES if (n, s) not in MATRIX]


def train_all(cases: list[tuple[str, str]]) -> list[float]:
    """On one rank: every case in turn."""
    return [train(*c) for c in cases]


shared_launch.register(2, "eager", lambda: (train_all, (MATRIX,)))


def _check(cases: list[tuple[str, str]], results: list[list[float]]) -> None:
    worst = {case: max(r[i] for r in results) for i, case in enumerate(cases)}
    assert all(w <= TOL for w in worst.values()), [f"{c}: {w:.1e}" for c, w in worst.items()]


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_eager_stages_train_like_one_process() -> None:
    pytest.importorskip("transformers")
    _check(MATRIX, shared_launch.results(2, "eager"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_model_under_every_schedule() -> None:
    pytest.importorskip("transformers")
    _check(SLOW, flexpipe.spawn(train_all, 2, SLOW, timeout_s=300, deadline_s=800))


@pytest.mark.parametrize("name", list(em.CASES))
def test_stages_in_turn_give_the_models_loss_and_gradients(name: str) -> None:
    if name != "branchy":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    model, stages, loss_fn, xs, y = em.CASES[name](em.POINTS[name]["zb-v"])
    got: tuple[torch.Tensor, ...] = tuple(t[:2] for t in xs)
    for stage in stages:
        got = stage(*got)
    ref = copy.deepcopy(model)
    out = ref(*(t[:2] for t in xs), labels=y[:2]).loss if hasattr(ref, "config") else \
        loss_fn(ref(*(t[:2] for t in xs)), y[:2])
    loss = loss_fn(*got, y[:2])
    assert loss.dtype == out.dtype and torch.equal(loss, out), (loss, out)
    loss.backward()
    out.backward()
    mine = dict(model.named_parameters())
    for n, p in ref.named_parameters():
        if p.grad is None:  # a branch not taken
            assert mine[n].grad is None, n
        else:
            assert torch.allclose(mine[n].grad, p.grad, rtol=1e-9, atol=1e-12), n


def test_w_is_deferred_for_the_linear_layers_of_eager_stages() -> None:
    from flexpipe.runtime.execution.segments import Segment
    from flexpipe.runtime.measurement.shares import deferred_shares

    torch.manual_seed(0)
    _, stages, _, xs, _ = em.branchy_case(("blocks.2",))
    shares = deferred_shares([Segment("", tuple(stages))], (xs[0][:2],), 2)
    assert all(s > 0.4 for s in shares), shares  # the branch not taken computes nothing


def test_a_forward_adding_around_its_blocks_is_refused_by_name() -> None:
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(ConfigError, match="cannot be cut eagerly at these split points"):
        eager_stages(em.Branchy(residual=True).double(), ("blocks.2",), x)
    with pytest.raises(ConfigError, match="not a block of an nn.ModuleList"):
        eager_stages(em.Branchy().double(), ("norm",), x)


def test_the_refusal_of_a_model_neither_traced_nor_exported_names_the_eager_path() -> None:
    from flexpipe.runtime.user.tracing import split_points

    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(ConfigError, match="nor export.*eager_stages"):
        split_points(em.Branchy().double(), ("blocks.2",), ((x,), {}))


class Gated(em.Branchy):
    """A module with parameters before the blocks that only batches of more than 2 call."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = self.extra(h) if x.shape[0] > 2 else h
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def test_a_module_the_example_never_calls_is_on_no_stage_and_refused_when_called() -> None:
    x = torch.randn(4, 6, dtype=torch.float64)
    stages = eager_stages(Gated().double(), ("blocks.2",), x[:2])
    assert not any("extra" in n for n, _ in stages.named_parameters())
    with pytest.raises(ConfigError, match="'extra'.*example's forward did not call"):
        stages[0](x)


def test_seq2seq_split_points_end_the_encoder_with_a_stage() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError, match="then the decoder's first block"):
        em.seq2seq_case(em.t5)(("encoder.block.1",))
    with pytest.raises(ConfigError, match="then the decoder's first block"):
        em.seq2seq_case(em.t5)(("decoder.block.1",))
