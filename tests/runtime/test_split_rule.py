"""The split's one rule on layers no other test builds (``flexpipe.runtime.split``): a
bilinear layer, a module calling ``torch.einsum`` and ``torch.baddbmm`` on its own parameters,
a LoRA-style low-rank product (a weight computed from two parameters): each defers every
weight to W with no code of its own, and B then W equals the fused backward to the bit. A
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
