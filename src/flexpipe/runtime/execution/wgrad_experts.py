"""The B/W split of a mixture of experts' products, which are patterns of graph nodes rather
than one operation with a parameter operand:

- ``bmm(W[ids], x)``: each row's expert matrix gathered from the experts' parameter by its
  expert id (Hugging Face's ``batched_mm`` experts), fused into ``gathered_bmm``;
- ``grouped_mm(x, W^T, offs)``: the rows sorted by expert, each group of rows times its
  expert's matrix (Hugging Face's ``grouped_mm`` experts, its default: ``aten._grouped_mm`` on
  a GPU, the ``transformers.grouped_mm_fallback`` operation where that kernel does not apply),
  fused into a ``grouped_product`` of the parameter itself.

While a weight-gradient store records, the fused product computes with the detached parameter,
so B computes and keeps only what dX needs, and a hook on its output hands dY to W with the
input (and the ids or offsets) kept since F. Otherwise it computes as the original nodes did.
``fuse(graph)`` rewrites a graph; ``wgrad_aten.rewrite`` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import fx

from flexpipe.runtime.execution import wgrad
from flexpipe.runtime.execution.wgrad import OutputHook, accumulate, trainable

aten = torch.ops.aten
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What ``torch._grouped_mm`` multiplies (its operands must also be 16-byte aligned)."""


def gathered_bmm(weight: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
                 weight_first: bool) -> torch.Tensor:
    """``bmm(weight[ids], x)`` (``weight_first``) or ``bmm(x, weight[ids])``: a mixture of
    experts' batched experts (Hugging Face's ``batched_mm``), each row's matrix gathered from
    the experts' parameter by its expert id. While a weight-gradient store records, the
    parameter's gradient (every row's outer product, summed into its expert) goes to W."""
    work = wgrad.current()
    if work is None or not trainable(weight) or not x.requires_grad:
        picked = aten.index.Tensor(weight, [ids])
        return aten.bmm.default(picked, x) if weight_first else aten.bmm.default(x, picked)
    picked = aten.index.Tensor(weight.detach(), [ids])
    y = aten.bmm.default(picked, x) if weight_first else aten.bmm.default(x, picked)
    xd = x.detach()
    work.keep(xd)
    work.keep(ids)
    work.note(weight)
    y.register_hook(OutputHook(work, xd, weight, None, _GatheredWGrad(ids, weight_first),
                               (ids,)))
    return y


class _GatheredWGrad:
    """W of ``gathered_bmm``: dW[ids[s]] += dY[s] X[s]^T (weight first) or X[s]^T dY[s], as
    autograd computes the backward of ``bmm`` and of the gather."""

    def __init__(self, ids: torch.Tensor, weight_first: bool) -> None:
        self.ids, self.weight_first = ids, weight_first

    def __call__(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        rows = dy.bmm(x.transpose(1, 2)) if self.weight_first else x.transpose(1, 2).bmm(dy)
        accumulate(weight, torch.zeros_like(weight).index_put_((self.ids,), rows,
                                                               accumulate=True))


def _gathered_operand(node: object) -> tuple[fx.Node, fx.Node] | None:
    """(weight, ids) when ``node`` is ``aten.index(weight, [ids])`` along the first dimension."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.index.Tensor):
        return None
    weight, index = node.args[0], node.args[1]
    if not (isinstance(weight, fx.Node) and isinstance(index, list | tuple) and len(index) == 1
            and isinstance(index[0], fx.Node)):
        return None
    return weight, index[0]


def _fuse_gathered(graph: fx.Graph, node: fx.Node) -> bool:
    """Point a ``bmm`` of a gathered matrix (``_gathered_operand``) at ``gathered_bmm``; a
    gather nothing else reads is dropped."""
    if node.target is not aten.bmm.default:
        return False
    for pos in (0, 1):
        found = _gathered_operand(node.args[pos])
        if found is None:
            continue
        gather = node.args[pos]
        node.target = gathered_bmm
        node.args = (found[0], found[1], node.args[1 - pos], pos == 0)
        _drop_if_unread(graph, gather)
        return True
    return False


def _by_kernel(call: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """``call()`` (a ``torch._grouped_mm``), or None where the kernel refuses the operands
    (their layout or alignment, the device)."""
    try:
        return call()
    except RuntimeError:
        return None


def _spans(offs: torch.Tensor) -> Iterator[tuple[int, int, int]]:
    """(group, first row, end row) of every non-empty group of ``offs`` (cumulative ends)."""
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            yield g, start, end
        start = end


def per_group(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor,
              kernel: bool) -> torch.Tensor:
    """Rows ``offs[g-1]:offs[g]`` of ``a`` (S, k) times ``b[g]`` (k, n): (S, n), by
    ``torch._grouped_mm`` (``kernel``, where it takes the operands) or one product per
    group."""
    if kernel and a.dtype in KERNEL_DTYPES:
        out = _by_kernel(lambda: torch._grouped_mm(a, b, offs=offs))
        if out is not None:
            return out
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for g, start, end in _spans(offs):
        torch.mm(a[start:end], b[g], out=out[start:end])
    return out


def group_outer(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                kernel: bool) -> torch.Tensor:
    """Per group g, ``x[rows]^T dy[rows]``: (E, k, n), the gradient of ``per_group``'s b."""
    if kernel and x.dtype in KERNEL_DTYPES:
        out = _by_kernel(lambda: torch._grouped_mm(x.t(), dy, offs=offs))
        if out is not None:
            return out
    out = x.new_zeros(offs.shape[0], x.shape[-1], dy.shape[-1])
    for g, start, end in _spans(offs):
        torch.mm(x[start:end].t(), dy[start:end], out=out[g])
    return out


class _GroupedInput(torch.autograd.Function):
    """The grouped product of an input and a detached weight: B computes dX only (from the
    weight view and the offsets, not the input)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
                native: Callable[..., torch.Tensor], kernel: bool) -> torch.Tensor:
        ctx.save_for_backward(w, offs)
        ctx.kernel = kernel
        return native(x, w, offs)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w, offs = ctx.saved_tensors
        return per_group(dy, w.transpose(-2, -1), offs, ctx.kernel), None, None, None, None


class _GroupedWGrad:
    """W of a grouped product: dW[g] = X[rows g]^T dY[rows g] (transposed back when the
    product took the parameter transposed)."""

    def __init__(self, offs: torch.Tensor, transposed: bool, kernel: bool) -> None:
        self.offs, self.transposed, self.kernel = offs, transposed, kernel

    def __call__(self, dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        grad = group_outer(x, dy, self.offs, self.kernel)
        accumulate(weight, grad.transpose(-2, -1).contiguous() if self.transposed else grad)


def grouped_product(native: Callable[..., torch.Tensor],
                    kernel: bool) -> Callable[..., torch.Tensor]:
    """The fused node's function for a grouped product computed by ``native(x, w, offs)``
    (``kernel``: whether ``native`` is torch's kernel, whose backward the split then uses
    too): ``(weight, x, offs, transposed)``, with ``w`` the parameter, transposed in its last
    two dimensions where the model transposed it."""

    def call(weight: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
             transposed: bool) -> torch.Tensor:
        w = weight.transpose(-2, -1) if transposed else weight
        work = wgrad.current()
        if work is None or not trainable(weight) or not x.requires_grad:
            return native(x, w, offs)
        y: torch.Tensor = _GroupedInput.apply(x, w.detach(), offs, native, kernel)
        xd = x.detach()
        work.keep(xd)
        work.keep(offs)
        work.note(weight)
        y.register_hook(OutputHook(work, xd, weight, None,
                                   _GroupedWGrad(offs, transposed, kernel), (offs,)))
        return y

    call.__name__ = call.__qualname__ = f"grouped_product_{getattr(native, '__name__', 'op')}"
    return call


GROUPED: Mapping[str, bool] = {"aten._grouped_mm.default": True, "_grouped_mm": True,
                               "grouped_mm": True,
                               "transformers.grouped_mm_fallback.default": False}
"""Grouped products ``(x, W, offs) -> y``, by the name of their graph target (an aten or
library operation, or torch's function in a torch.fx graph) -> whether torch's kernel computes
them. Hugging Face's fallback is known by name: its library need not be imported."""
_FUSED: dict[Any, Callable[..., torch.Tensor]] = {}


def _name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    torch_function = module.startswith("torch") or target is torch._grouped_mm
    return getattr(target, "__name__", "") if torch_function else ""


def _grouped_target(node: fx.Node) -> Callable[..., torch.Tensor] | None:
    """The fused function for ``node`` when it is a grouped product without bias."""
    kernel = GROUPED.get(_name(node.target))
    extra = list(node.args[3:]) + [v for k, v in node.kwargs.items() if k != "offs"]
    if kernel is None or any(v is not None for v in extra):
        return None
    if node.target not in _FUSED:
        _FUSED[node.target] = grouped_product(node.target, kernel)  # type: ignore[arg-type]
    return _FUSED[node.target]


LAST_TWO = ((-2, -1), (-1, -2), (1, 2), (2, 1))


def _grouped_weight(node: object) -> tuple[fx.Node, bool] | None:
    """(the parameter's node, whether the product takes it transposed in its last two
    dimensions) when ``node`` is a parameter or such a transpose of one."""
    if not isinstance(node, fx.Node):
        return None
    if node.op in ("placeholder", "get_attr"):
        return node, False
    transpose = (node.op == "call_function" and node.target is aten.transpose.int) or \
        (node.op == "call_method" and node.target == "transpose")
    if transpose and isinstance(node.args[0], fx.Node) and \
            node.args[0].op in ("placeholder", "get_attr") and tuple(node.args[1:3]) in LAST_TWO:
        return node.args[0], True
    return None


def _fuse_grouped(graph: fx.Graph, node: fx.Node) -> bool:
    """Point a grouped product of a parameter at its ``grouped_product``; a transpose
    nothing else reads is dropped."""
    target = _grouped_target(node)
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    found = _grouped_weight(node.args[1]) if target is not None and len(node.args) > 1 else None
    if found is None or not isinstance(offs, fx.Node):
        return False
    view = node.args[1]
    node.target = target  # type: ignore[assignment]
    node.args, node.kwargs = (found[0], node.args[0], offs, found[1]), {}
    _drop_if_unread(graph, view)
    return True


def _drop_if_unread(graph: fx.Graph, node: object) -> None:
    """Erase an intermediate operation the fusion left without readers."""
    if isinstance(node, fx.Node) and node.op in ("call_function", "call_method") \
            and not node.users:
        graph.erase_node(node)


FUSIONS = (_fuse_gathered, _fuse_grouped)
"""Each pattern's fusion: ``fusion(graph, node)`` rewrites ``node`` in place, or says False."""


def fuse(graph: fx.Graph) -> int:
    """Fuse every experts' product of ``graph`` (``FUSIONS``); how many were fused."""
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and any(f(graph, node) for f in FUSIONS):
            count += 1
    return count
