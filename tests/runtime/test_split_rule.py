"""The split's one rule on layers no other test builds (``flexpipe.runtime.split``): a
bilinear layer, a module calling ``torch.einsum`` and ``torch.baddbmm`` on its own parameters,
a LoRA-style low-rank product (a weight computed from two parameters), and Hugging Face
families outside the runtime's family table (SqueezeBERT's grouped convolutions, CTRL): each
defers every weight to W with no code of its own, and B then W equals the fused backward to the
bit. A
weight read outside any product (``torch.cdist`` to learned centres) keeps its gradient in B,
correct, and the stage is told: ``recorded_share`` below 1 and one ``SplitNotice`` naming the
module."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from flexpipe.runtime.split import SplitNotice, WeightWork, notice, recorded_share, recording

WIDTH = 5


class Mixer(nn.Module):
    """``einsum`` with one parameter, ``baddbmm`` with two."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.randn(3, WIDTH, WIDTH, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(1, 1, WIDTH, dtype=torch.float64))
        self.gate = nn.Parameter(torch.randn(3, WIDTH, WIDTH, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("bsi,bij->bsj", x, self.mix)
        return torch.baddbmm(self.bias, torch.tanh(h), self.gate)


class LowRank(nn.Module):
    """A frozen weight plus a trainable low-rank update, ``x (W + B A)^T``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(WIDTH, WIDTH, dtype=torch.float64),
                                 requires_grad=False)
        self.a = nn.Parameter(torch.randn(2, WIDTH, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(WIDTH, 2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.base + self.b @ self.a).t()


class Bilinear(nn.Module):
    """``nn.Bilinear`` of the input and its square."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Bilinear(WIDTH, WIDTH, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x * x)  # type: ignore[no-any-return]


class Centres(nn.Module):
    """A linear layer, then distances to learned centres (``cdist``: not a product)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH).double()
        self.centres = nn.Parameter(torch.randn(4, WIDTH, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cdist(self.proj(x), self.centres.expand(x.shape[0], 4, WIDTH))


LAYERS = {"einsum and baddbmm": Mixer, "low rank": LowRank, "bilinear": Bilinear,
          "cdist": Centres}


def _both(make: type[nn.Module]) -> tuple[nn.Module, nn.Module, WeightWork]:
    """The fused module and its split twin after one backward each (B then W)."""
    torch.manual_seed(0)
    fused = make()
    split = copy.deepcopy(fused)
    x = torch.randn(3, 4, WIDTH, dtype=torch.float64)
    fused(x.clone().requires_grad_()).sum().backward()
    work = WeightWork()
    with recording(work):
        out = split(x.clone().requires_grad_())
    with work.backward_input():
        out.sum().backward()
    work.run()
    return fused, split, work


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layer_of_listed_products_splits_exactly(name: str) -> None:
    fused, split, _ = _both(LAYERS[name])
    for (pname, p), q in zip(split.named_parameters(), fused.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), (name, pname)


@pytest.mark.parametrize("name", ["einsum and baddbmm", "low rank", "bilinear"])
def test_b_leaves_every_weight_of_listed_products_to_w(name: str) -> None:
    torch.manual_seed(0)
    module = LAYERS[name]()
    work = WeightWork()
    with recording(work):
        out = module(torch.randn(3, 4, WIDTH, dtype=torch.float64, requires_grad=True))
    with work.backward_input():
        out.sum().backward()
    assert all(p.grad is None for p in module.parameters())
    assert recorded_share(module, work) == 1.0
    work.run()
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)


def test_a_weight_read_outside_a_product_is_reported() -> None:
    _, split, work = _both(Centres)
    assert recorded_share(split, work) == pytest.approx(30 / 50)  # proj's 30 of 50 elements
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        notice(3, split, work)
    said = [str(w.message) for w in seen if issubclass(w.category, SplitNotice)]
    assert len(said) == 1 and "stage 3" in said[0] and "Centres" in said[0] \
        and "60%" in said[0]


def _hf(name: str) -> nn.Module:
    """A tiny Hugging Face encoder of a family the runtime's family table does not hold:
    SqueezeBERT (grouped ``Conv1d`` projections), CTRL (its own attention of ``nn.Linear`` and
    ``matmul``), Funnel (relative-position biases added to the queries: read outside a
    product)."""
    tr = pytest.importorskip("transformers")
    small = dict(vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    make = {
        "squeezebert": lambda: tr.SqueezeBertModel(tr.SqueezeBertConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            embedding_size=16, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
            intermediate_groups=2, output_groups=2, **small)),
        "ctrl": lambda: tr.CTRLModel(tr.CTRLConfig(vocab_size=50, n_embd=16, n_layer=2,
                                                   n_head=2, dff=32, resid_pdrop=0.0,
                                                   embd_pdrop=0.0)),
        "funnel": lambda: tr.FunnelBaseModel(tr.FunnelConfig(
            vocab_size=50, d_model=16, n_head=2, d_head=8, d_inner=32, block_sizes=[1, 1],
            hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)),
    }[name]
    torch.manual_seed(0)
    return make().double()  # type: ignore[no-any-return]


def _hf_both(name: str) -> tuple[nn.Module, nn.Module, WeightWork]:
    """``_both`` for a Hugging Face encoder on token ids (the sum of its last hidden state)."""
    fused = _hf(name)
    split = copy.deepcopy(fused)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    fused(input_ids=ids).last_hidden_state.sum().backward()
    work = WeightWork()
    with recording(work):
        out = split(input_ids=ids).last_hidden_state.sum()
    with work.backward_input():
        out.backward()
    work.run()
    return fused, split, work


@pytest.mark.parametrize("name", ["squeezebert", "ctrl", "funnel"])
def test_a_hugging_face_family_outside_the_table_splits_exactly(name: str) -> None:
    fused, split, work = _hf_both(name)
    for (pname, p), q in zip(split.named_parameters(), fused.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), pname
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), (name, pname)
    in_b = [n for n, p in split.named_parameters() if p.dim() >= 2 and id(p) not in work.deferred]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        notice(0, split, work)
    said = [str(w.message) for w in seen if issubclass(w.category, SplitNotice)]
    if name == "funnel":  # r_w_bias and its kin are added to the queries: B, and said
        assert in_b and all(n.rsplit(".", 1)[-1].startswith("r_") for n in in_b), in_b
        assert len(said) == 1 and "attention" in said[0]
    else:  # every matrix (projections, grouped convolutions, embeddings) deferred to W
        assert in_b == [] and said == []
