"""What a stage's inputs may be, at 2 gloo ranks (the shared 2-process launch):

- a model whose blocks start with ``nn.ReLU(inplace=True)`` (Xception-like), traced and cut at
  a block, trains like one process (its second stage's first op writes into the received
  tensor, a leaf of the stage's graph: the stage gets a copy);
- an exported Hugging Face model refuses, with the same ``ConfigError`` on both ranks and
  before any message, a batch whose micro-batches do not have the example's shape (training
  and ``eval``), inputs of another dtype, and inputs by position where it was traced with
  keywords; the pipeline then still trains.

``check_inputs`` is also checked in this process against an exported graph's signature."""

from __future__ import annotations

from typing import Any

import pytest
import shared_launch
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.user.interface import Interface, check_inputs


class ReluFirst(nn.Module):
    """A stem and four blocks, each an in-place ReLU then a linear layer, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8))
                                    for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randn(8, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=gen))


def _relu_first() -> nn.Module:
    torch.manual_seed(0)
    return ReluFirst().double()


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).double()


def _refused(call: Any) -> str:
    try:
        call()
    except ConfigError as exc:
        return str(exc)
    return "accepted"


def inputs_main() -> dict[str, Any]:
    """This rank's gradients of the in-place model, and what the exported model says to each
    bad call (then the loss of a good step)."""
    out: dict[str, Any] = {}
    x, y = _data()
    pipe = flexpipe.pipeline(_relu_first(), "1f1b", loss_fn=fn.cross_entropy, m=4,
                             split_points=["blocks.2"], example=x[:2])
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    out["grads"] = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return out
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
    gpt = flexpipe.pipeline(_gpt2(), "1f1b", m=4, split_points=["transformer.h.1"],
                            example={"input_ids": ids[:2], "labels": ids[:2]})
    first = gpt.needs_inputs

    def step(**batch: torch.Tensor) -> Any:
        return lambda: gpt.step(**(batch if first else {}))
    out["shape"] = _refused(step(input_ids=ids[:, :4], labels=ids[:, :4]))
    out["samples"] = _refused(step(input_ids=ids[:4], labels=ids[:4]))
    out["dtype"] = _refused(step(input_ids=ids.int(), labels=ids.int()))
    out["position"] = _refused(lambda: gpt.step(ids if first else None))
    out["eval"] = _refused(lambda: gpt.eval(**({"input_ids": ids[:4], "labels": ids[:4]}
                                               if first else {})))
    loss = gpt.step(**({"input_ids": ids, "labels": ids} if first else {}))
    out["after"] = None if loss is None else float(loss)
    return out


shared_launch.register(2, "stage-inputs", lambda: (inputs_main, ()))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return shared_launch.results(2, "stage-inputs")


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_stage_that_starts_in_place_trains_like_one_process(
        ranks: list[dict[str, Any]]) -> None:
    model = _relu_first()
    x, y = _data()
    for xj, yj in zip(x.chunk(4), y.chunk(4), strict=True):
        (fn.cross_entropy(model(xj), yj) / 4).backward()
    want = dict(model.named_parameters())
    got = {n: g for r in ranks for n, g in r["grads"].items()}
    assert set(got) == set(want)
    for n, g in got.items():
        assert torch.allclose(g, want[n].grad, rtol=1e-10, atol=1e-12), n


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize(("case", "words"), [
    ("shape", ["'input_ids'", "(2, 4)", "example's (2, 8)"]),
    ("samples", ["'input_ids'", "(1, 8)", "a batch of m x 2 samples"]),
    ("dtype", ["'input_ids'", "torch.int32", "torch.int64"]),
    ("position", ["traced with 2 inputs", "by keyword"]),
    ("eval", ["'input_ids'", "(1, 8)"]),
])
def test_a_call_the_exported_graph_cannot_take_is_refused_on_every_rank(
        ranks: list[dict[str, Any]], case: str, words: list[str]) -> None:
    pytest.importorskip("transformers")
    for got in ranks:
        for word in words:
            assert word in got[case], (case, got[case])
    assert any(r["after"] is not None for r in ranks)  # and it still trains


def test_check_inputs_reads_an_exported_signature() -> None:
    face = Interface(("x", "mask"), None, (((2, None), torch.float32), None))
    check_inputs(face, (torch.zeros(2, 7), torch.zeros(3)))  # a free dimension, an unfixed input
    with pytest.raises(ConfigError, match=r"input 'x': a micro-batch of shape \(3, 7\)"):
        check_inputs(face, (torch.zeros(3, 7), torch.zeros(3)))
    with pytest.raises(ConfigError, match="torch.float64"):
        check_inputs(face, (torch.zeros(2, 7, dtype=torch.float64), torch.zeros(3)))
    with pytest.raises(ConfigError, match=r"traced with 2 inputs \['x', 'mask'\], got 1"):
        check_inputs(face, (torch.zeros(2, 7),))
    check_inputs(Interface(), (torch.zeros(5),))  # a chain of layers: nothing fixed
    check_inputs(Interface(("x", "mask")), (torch.zeros(5),))  # traced without shapes


class NormThenInPlace(nn.Module):
    """A BatchNorm reads (a scaled copy of) the input, then a ReLU writes into the input
    itself."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x * 2.0)
        return y + torch.relu_(x)


def test_a_stage_runs_again_on_copies_with_its_statistics_put_back() -> None:
    """The first forward finds the in-place write into its input (a leaf) after the norm
    counted the batch; the stage puts the norm's statistics back and runs on copies: the
    statistics count the batch once, the gradients are one process's."""
    torch.manual_seed(0)
    ref = NormThenInPlace().double()
    stage = StageModule([NormThenInPlace().double()], 0)
    stage.layers[0].load_state_dict(ref.state_dict())
    x = torch.randn(6, 4, dtype=torch.float64)
    with torch.no_grad():
        stage(x.clone())  # a forward that builds no graph does not decide it
        ref(x.clone())
    leaf = x.clone().requires_grad_()
    (out,) = stage(leaf)
    h = x.clone().requires_grad_()
    want = ref(h * 1.0)  # one device: the block's input is an intermediate, not a leaf
    out.sum().backward()
    want.sum().backward()
    assert stage.copies_inputs
    assert torch.allclose(out, want) and torch.allclose(leaf.grad, h.grad)
    for a, b in zip(stage.layers[0].buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b)
