"""The products of a mixture of experts, split into B and W by the one rule
(``flexpipe.runtime.split.rule``) with no code of their own: torch's grouped product
(``torch._grouped_mm``, with an empty group and a weight taken transposed) and experts gathered
per token (``torch.bmm(W[ids], x)``: the gathered weight is computed from the parameter alone),
each against autograd through a loop over the groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexpipe.runtime.split import WeightWork, recording

OFFS = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # group 1 is empty


def _loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A grouped product as the reference: one product per group, by autograd."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends, strict=True))])


def _split(weight: nn.Parameter, x: torch.Tensor, dy: torch.Tensor, product: object
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x's and the weight's gradients of ``product(weight, x)`` split into B then W; B must
    leave the weight's to W."""
    work = WeightWork()
    with recording(work):
        y = product(weight, x)  # type: ignore[operator]
    with work.backward_input():
        y.backward(dy)
    assert weight.grad is None and work.pending  # B left it to W
    work.run()
    assert x.grad is not None and weight.grad is not None
    return x.grad, weight.grad


@pytest.mark.parametrize("transposed", [True, False])
def test_split_grouped_product_equals_autograd(transposed: bool) -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 4, 8) if transposed else torch.randn(4, 8, 4))
    x = torch.randn(10, 8, requires_grad=True)
    dy = torch.randn(10, 4)

    def view(w: torch.Tensor) -> torch.Tensor:
        return w.transpose(-2, -1) if transposed else w
    _loop(x, view(weight), OFFS).backward(dy)
    want_x, want_w = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    got_x, got_w = _split(weight, x, dy, lambda w, v: torch._grouped_mm(v, view(w), offs=OFFS))
    assert torch.allclose(got_x, want_x, atol=1e-5)
    assert torch.allclose(got_w, want_w, atol=1e-5)
    assert not got_w[1].any()  # the empty group's expert


def test_experts_gathered_per_token_split_exactly() -> None:
    """``bmm(W[ids], x)``: each token's expert gathered from the parameter (a computed
    weight), then one batched product: B then W gives the fused gradients to the bit."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 6, 5, dtype=torch.float64))
    ids = torch.tensor([2, 0, 2, 3, 1, 2])
    x = torch.randn(6, 5, 1, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(6, 6, 1, dtype=torch.float64)
    torch.bmm(weight[ids], x).backward(dy)
    want_x, want_w = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    got_x, got_w = _split(weight, x, dy, lambda w, v: torch.bmm(w[ids], v))
    assert torch.equal(got_x, want_x) and torch.equal(got_w, want_w)
