"""The grouped product of a mixture of experts (``wgrad_experts``), split into B and W on its
own: against autograd through torch's kernel and through a loop over the groups, with an
empty group, a weight taken transposed, and operands the kernel refuses."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from flexpipe.runtime.execution import wgrad_experts as experts
from flexpipe.runtime.execution.wgrad import WeightWork, recording

OFFS = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # group 1 is empty


def _loop(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A grouped product as the reference: one product per group, by autograd."""
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    return torch.cat([x[a:b] @ w[g] for g, (a, b) in enumerate(zip(starts, ends, strict=True))])


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("transposed", [True, False])
def test_split_grouped_product_equals_autograd(kernel: bool, transposed: bool) -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 4, 8) if transposed else torch.randn(4, 8, 4))
    x = torch.randn(10, 8, requires_grad=True)
    dy = torch.randn(10, 4)
    w = weight.transpose(-2, -1) if transposed else weight
    _loop(x, w, OFFS).backward(dy)
    want_x, want_w = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    native = torch._grouped_mm if kernel else _loop
    product = experts.grouped_product(native, kernel)
    work = WeightWork()
    with recording(work):
        y = product(weight, x, OFFS, transposed)
    with work.backward_input():
        y.backward(dy)
    assert weight.grad is None  # B left it to W
    assert torch.allclose(x.grad, want_x, atol=1e-5)
    work.run()
    assert torch.allclose(weight.grad, want_w, atol=1e-5)
    assert not weight.grad[1].any()  # the empty group's expert


def test_operands_the_kernel_refuses_are_computed_group_by_group() -> None:
    """torch's kernel wants 16-byte aligned strides: 3 bfloat16 columns are 6 bytes."""
    x = torch.randn(10, 8, dtype=torch.bfloat16)
    w = torch.randn(4, 8, 3, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(x, w, offs=OFFS)
    got = experts.per_group(x, w, OFFS, kernel=True)
    assert torch.equal(got, _loop(x, w, OFFS))


def test_a_graph_of_a_transposed_parameter_is_fused() -> None:
    """``_grouped_mm(x, W.transpose(-2, -1), offs)`` becomes one node of the parameter; a
    product of a computed weight is left alone."""
    graph = fx.Graph()
    x, offs, w = (graph.placeholder(n) for n in ("x", "offs", "w"))
    t = graph.call_function(torch.ops.aten.transpose.int, (w, -2, -1))
    y = graph.call_function(torch.ops.aten._grouped_mm.default, (x, t, offs))
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (w, 2))
    z = graph.call_function(torch.ops.aten._grouped_mm.default, (x, doubled, offs))
    graph.output((y, z))
    assert experts.fuse(graph) == 1
    assert y.args == (w, x, offs, True) and t not in graph.nodes
    assert z.target is torch.ops.aten._grouped_mm.default
