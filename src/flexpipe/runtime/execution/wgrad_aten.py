"""The B/W split for models that are graphs of operations, not ``torch.nn`` layers.

A model exported with ``torch.export`` (every Hugging Face model: its stages are graphs of aten
operations with the parameters lifted out of their modules) or traced by ``torch.fx`` through a
module of its own (``x @ self.weight``, Hugging Face's ``Conv1D``) computes its products with
functions, not with ``nn.Linear``. ``rewrite(module)`` gives every graph inside ``module`` a
deferring version of each product whose weight operand can be a parameter — ``linear``,
``addmm``, ``mm``, ``matmul``, ``embedding`` and the convolutions, as aten operations
(``torch.ops.aten.addmm.default``) and as torch functions (``torch.addmm``, ``F.linear``,
``operator.matmul``) — chosen by ``RULES``, the one table (operation -> rule). A mixture of
experts' batched product of matrices gathered from a parameter by expert id
(``bmm(W[ids], x)``, Hugging Face's ``batched_mm`` experts) is a pattern of two nodes, fused
into ``gathered_bmm``.

At run time a deferring operation checks, on each call, that a weight-gradient store is recording
(``wgrad.recording``) and that its weight operand is an ``nn.Parameter``; then it runs as the
split layers do: the native operation on the detached weight (autograd saves only what the input
gradient needs) and a hook on the output that hands dY to W with the input X kept since F, or
one of ``wgrad``'s autograd functions. Anything else (no recording, a computed weight, ``beta`` or
``alpha`` of ``addmm`` not 1, a string padding) calls the original operation unchanged, so a
fused backward and a single-device run compute exactly as before.

``NAMED_FORWARDS`` does the same for module classes known by name without importing their
library (Hugging Face's ``Conv1D``, a linear layer with its weight stored (in, out)).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as fn

from flexpipe.runtime.execution import wgrad
from flexpipe.runtime.execution.wgrad import OutputHook, WeightWork, accumulate

Native = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
Rule = Callable[..., "torch.Tensor | None"]
"""``rule(work, *args, **kwargs)``: the split result of one call, or None (not a split case)."""
aten = torch.ops.aten


def _weight(t: object) -> bool:
    """A parameter that wants its gradient (never a stage input, which is a plain leaf)."""
    return isinstance(t, nn.Parameter) and t.requires_grad


def _weight_or_none(t: object) -> bool:
    return t is None or _weight(t)


def _product_wgrad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> None:
    """For ``y = x @ W + b`` (W stored (in, out)): dW = X^T dY, db = sum dY, accumulated."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    accumulate(weight, x.reshape(-1, x.shape[-1]).t().mm(dy2))
    if bias is not None:
        accumulate(bias, dy2.sum(0))


def split_product(work: WeightWork, native: Native, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor | None:
    """``native(x, W, b)`` = ``x @ W + b`` with its weight gradient through ``work``; None
    where the input carries no graph (the original operation then computes dW in B)."""
    if not x.requires_grad:
        return None
    if x.dim() > 2 and not x.is_contiguous():
        x = x.contiguous()
    y = native(x, weight.detach(), None if bias is None else bias.detach())
    xd = x.detach()
    work.keep(xd)
    work.note(weight, bias)
    y.register_hook(OutputHook(work, xd, weight, bias, _product_wgrad))
    return y


def _linear(work: WeightWork, x: torch.Tensor, w: Any, b: Any = None) -> torch.Tensor | None:
    if not (_weight(w) and _weight_or_none(b)):
        return None
    return wgrad.split_linear(x, w, b, work)


def _addmm(work: WeightWork, b: Any, x: torch.Tensor, w: Any, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor | None:
    if beta != 1 or alpha != 1 or x.dim() != 2 or not (_weight(w) and _weight_or_none(b)) \
            or (b is not None and b.dim() != 1):
        return None
    return split_product(work, lambda x, w, b: aten.addmm(b, x, w), x, w, b)


def _mm(work: WeightWork, x: torch.Tensor, w: Any) -> torch.Tensor | None:
    if x.dim() != 2 or not _weight(w):
        return None
    return split_product(work, lambda x, w, _: aten.mm(x, w), x, w, None)


def _matmul(work: WeightWork, x: Any, w: Any) -> torch.Tensor | None:
    if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and _weight(w) and w.dim() == 2):
        return None
    return split_product(work, lambda x, w, _: torch.matmul(x, w), x, w, None)


def _aten_embedding(work: WeightWork, w: Any, ids: torch.Tensor, padding_idx: int = -1,
                    scale_grad_by_freq: bool = False, sparse: bool = False
                    ) -> torch.Tensor | None:
    if sparse or not _weight(w):
        return None
    return wgrad.split_embedding(ids, w, work, padding_idx, scale_grad_by_freq)


def _fn_embedding(work: WeightWork, ids: torch.Tensor, w: Any, padding_idx: int | None = None,
                  max_norm: float | None = None, norm_type: float = 2.0,
                  scale_grad_by_freq: bool = False, sparse: bool = False
                  ) -> torch.Tensor | None:
    if sparse or max_norm is not None or not _weight(w):
        return None
    pad = -1 if padding_idx is None else padding_idx % w.shape[0]
    return wgrad.split_embedding(ids, w, work, pad, scale_grad_by_freq)


_CONVS: Mapping[int, Callable[..., torch.Tensor]] = {1: fn.conv1d, 2: fn.conv2d, 3: fn.conv3d}


def _spread(v: Any, n: int) -> tuple[int, ...]:
    """A convolution argument (an int or a sequence) as one int per spatial dimension."""
    return tuple(int(i) for i in v) if isinstance(v, list | tuple) else (int(v),) * n


def _conv(work: WeightWork, x: torch.Tensor, w: Any, b: Any = None, stride: Any = 1,
          padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor | None:
    if isinstance(padding, str) or not (_weight(w) and _weight_or_none(b)):
        return None
    n = w.dim() - 2
    geom = (_CONVS[n], _spread(stride, n), _spread(padding, n), _spread(dilation, n), groups)
    return wgrad.split_conv(x, w, b, work, geom)


def _convolution(work: WeightWork, x: torch.Tensor, w: Any, b: Any, stride: Any, padding: Any,
                 dilation: Any, transposed: bool, output_padding: Any, groups: int
                 ) -> torch.Tensor | None:
    if transposed:
        return None
    return _conv(work, x, w, b, stride, padding, dilation, groups)


RULES: Mapping[Any, Rule] = {
    aten.linear.default: _linear, fn.linear: _linear,
    aten.addmm.default: _addmm, torch.addmm: _addmm,
    aten.mm.default: _mm, torch.mm: _mm,
    aten.matmul.default: _matmul, torch.matmul: _matmul, operator.matmul: _matmul,
    aten.embedding.default: _aten_embedding, fn.embedding: _fn_embedding,
    aten.conv1d.default: _conv, aten.conv2d.default: _conv, aten.conv3d.default: _conv,
    fn.conv1d: _conv, fn.conv2d: _conv, fn.conv3d: _conv,
    aten.convolution.default: _convolution,
}
"""The one table: operation (as a graph node's target) -> its split rule."""


def _deferring(original: Callable[..., Any], rule: Rule) -> Callable[..., Any]:
    """``original``, split by ``rule`` while a weight-gradient store records."""

    def call(*args: Any, **kwargs: Any) -> Any:
        work = wgrad.current()
        if work is not None:
            out = rule(work, *args, **kwargs)
            if out is not None:
                return out
        return original(*args, **kwargs)

    name = getattr(original, "__name__", "op").replace(".", "_")
    call.__name__ = call.__qualname__ = f"deferring_{name}"
    call.__wrapped__ = original  # type: ignore[attr-defined]
    return call


DEFERRING: Mapping[Any, Callable[..., Any]] = {t: _deferring(t, r) for t, r in RULES.items()}
"""Each operation of ``RULES`` -> the deferring function a rewritten graph calls instead."""


def gathered_bmm(weight: torch.Tensor, ids: torch.Tensor, x: torch.Tensor,
                 weight_first: bool) -> torch.Tensor:
    """``bmm(weight[ids], x)`` (``weight_first``) or ``bmm(x, weight[ids])``: a mixture of
    experts' batched experts (Hugging Face's ``batched_mm``), each row's matrix gathered from
    the experts' parameter by its expert id. While a weight-gradient store records, the
    parameter's gradient (every row's outer product, summed into its expert) goes to W."""
    work = wgrad.current()
    if work is None or not _weight(weight) or not x.requires_grad:
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


def _fuse_gathered(graph: fx.Graph) -> int:
    """Point every ``bmm`` of a gathered matrix (``_gathered_operand``) at ``gathered_bmm``;
    a gather nothing else reads is dropped. How many were fused."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.bmm.default:
            continue
        for pos in (0, 1):
            found = _gathered_operand(node.args[pos])
            if found is None:
                continue
            gather = node.args[pos]
            node.target = gathered_bmm
            node.args = (found[0], found[1], node.args[1 - pos], pos == 0)
            if isinstance(gather, fx.Node) and not gather.users:
                graph.erase_node(gather)
            count += 1
            break
    return count


def rewrite(module: nn.Module) -> int:
    """Point every graph node of ``module`` (its own graph and its submodules') that calls an
    operation of ``RULES`` at the deferring version, and every batched product of gathered
    experts at ``gathered_bmm``, recompiling what changed; idempotent. Returns how many nodes
    were rewritten."""
    count = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        changed = _fuse_gathered(graph)
        for node in graph.nodes:
            if node.op == "call_function" and _hashable(node.target) in DEFERRING:
                node.target = DEFERRING[node.target]
                changed += 1
        if changed:
            _recompile(sub)
        count += changed
    return count


def _hashable(target: Any) -> Any:
    try:
        hash(target)
    except TypeError:
        return None
    return target


def _recompile(sub: nn.Module) -> None:
    """Regenerate the code of a graph module (or of an unflattened module's graph module)."""
    for gm in (sub, getattr(sub, "graph_module", None)):
        if isinstance(gm, fx.GraphModule):
            gm.recompile()


def _hf_conv1d_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``Conv1D`` (``y = x @ W + b``, W of shape (in, out)), split."""
    size_out = x.size()[:-1] + (self.nf,)
    flat = x.view(-1, x.size(-1))
    work = wgrad.current()
    out = None if work is None else _addmm(work, self.bias, flat, self.weight)
    if out is None:
        out = torch.addmm(self.bias, flat, self.weight)
    return out.view(size_out)


NAMED_FORWARDS: Mapping[str, Callable[..., Any]] = {
    "transformers.pytorch_utils.Conv1D": _hf_conv1d_forward,
}
"""Module class (``module.qualname``, so its library need not be imported) -> split forward."""
