"""The B/W split for models that are graphs of operations, not ``torch.nn`` layers.

A model exported with ``torch.export`` (every Hugging Face model: its stages are graphs of aten
operations with the parameters lifted out of their modules) or traced by ``torch.fx`` through a
module of its own (``x @ self.weight``, Hugging Face's ``Conv1D``) computes its products with
functions, not with ``nn.Linear``. ``rewrite(module)`` gives every graph inside ``module`` a
deferring version of each product whose weight operand can be a parameter — ``linear``,
``addmm``, ``mm``, ``bmm``, ``matmul``, ``einsum``, ``embedding`` and the convolutions,
transposed too (a
product may read its parameter through a view, ``x @ self.weight.T``, take it on the left,
``self.weight @ x``, or hold one matrix per batch entry, Llama 4's experts'
``bmm(x, self.gate_up_proj)``), as aten operations (``torch.ops.aten.addmm.default``) and as
torch functions (``torch.addmm``, ``F.linear``, ``operator.matmul``) — chosen by ``RULES``,
the one table (operation -> rule). A mixture of experts' products are patterns of nodes,
fused by ``wgrad_experts``.

At run time a deferring operation checks, on each call, that a weight-gradient store is recording
(``wgrad.recording``) and that its weight operand is an ``nn.Parameter``, a view of one
that reads no element twice, or a weight the graph computes from its parameters alone
(``wgrad.weight_operand``: ``mark_computed`` notes such nodes on the whole model's graph
before it is cut, and ``rewrite`` tags each product operand among them that only products
read, ``wgrad.computed_weight``); then it runs as the
split layers do: the native operation on the detached weight (autograd saves only what the input
gradient needs) and a hook on the output that hands dY to W with the input X kept since F, or
one of ``wgrad``'s autograd functions. A convolution's string padding (``same``, ``valid``)
runs as numbers (``wgrad_conv.numeric_padding``). Anything else (no recording, a weight computed
from an input or read by more than products, ``beta`` or ``alpha`` of ``addmm`` not 1) calls
the original operation unchanged, so a fused backward and a single-device run compute exactly
as before.

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

from flexpipe.runtime.execution import wgrad, wgrad_conv, wgrad_rnn
from flexpipe.runtime.execution import wgrad_experts as experts
from flexpipe.runtime.execution.wgrad import Native, WeightWork, accumulate, split_product
from flexpipe.runtime.execution.wgrad_layers import split_embedding

Rule = Callable[..., "torch.Tensor | tuple[torch.Tensor, ...] | None"]
"""``rule(work, *args, **kwargs)``: the split result of one call (a recurrent layer's: its
output and final states), or None (not a split case)."""
aten = torch.ops.aten


_weight = wgrad.weight_operand


def _weight_or_none(t: object) -> bool:
    return t is None or _weight(t)


def _product_wgrad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> None:
    """For ``y = x @ W + b`` (W stored (in, out)): dW = X^T dY, db = sum dY, accumulated."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    accumulate(weight, x.reshape(-1, x.shape[-1]).t().mm(dy2))
    if bias is not None:
        accumulate(bias, dy2.sum(0))


def _batched_wgrad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> None:
    """For ``y = X @ W`` with one W per batch entry (a mixture's experts, ``bmm(x, W)``; W's
    batch dims may broadcast, Zamba's ``W[:, None] @ x``): dW = X^T dY entry by entry, summed
    where W broadcasts."""
    accumulate(weight, torch.matmul(x.mT, dy).sum_to_size(weight.shape))


def _left_wgrad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> None:
    """For ``y = W @ X`` (W 2-D, shared by every batch entry, or one W per entry): dW = dY X^T
    entry by entry, summed where W broadcasts (over the whole batch for a 2-D W)."""
    accumulate(weight, torch.matmul(dy, x.mT).sum_to_size(weight.shape))


def _linear(work: WeightWork, x: torch.Tensor, w: Any, b: Any = None) -> torch.Tensor | None:
    if not (_weight(w) and _weight_or_none(b)):
        return None
    return wgrad.split_linear(x, w, b, work)


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _product(work: WeightWork, x: Any, w: Any, native: Product) -> torch.Tensor | None:
    """``native(x, w)``, a matrix product, split where one operand is a weight: on the right
    (``x @ W``: W 2-D, shared by every row, or one W per batch entry of ``x``) or on the left
    (``W @ x``, Mamba's ``dt_proj.weight @ x``)."""
    if _weight(x) and not _weight(w):
        x, w, left = w, x, True
    elif _weight(w):
        left = False
    else:
        return None
    if not (isinstance(x, torch.Tensor) and x.dim() >= 2 and x.dim() >= w.dim()):
        return None
    shared = w.dim() == 2
    if not (shared or _broadcasts(w.shape[:-2], x.shape[:-2])):
        return None
    wgrad_of = _left_wgrad if left else _product_wgrad if shared else _batched_wgrad
    order: Native = (lambda x, w, _: native(w, x)) if left else (lambda x, w, _: native(x, w))
    return split_product(work, order, x, w, None, wgrad_of)


def _addmm(work: WeightWork, b: Any, x: torch.Tensor, w: Any, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor | None:
    if beta != 1 or alpha != 1 or x.dim() != 2 or not _weight(w) \
            or not _weight_or_none(b) or (b is not None and b.dim() != 1):
        return None
    return split_product(work, lambda x, w, b: aten.addmm(b, x, w), x, w, b,
                         _product_wgrad)


def _broadcasts(w: torch.Size, x: torch.Size) -> bool:
    """Whether a weight's batch dims ``w`` broadcast to the input's ``x`` (the product's)."""
    return len(w) <= len(x) and all(a in (1, b) for a, b in zip(reversed(w), reversed(x),
                                                                 strict=False))


def _einsum(work: WeightWork, equation: Any, *operands: Any, path: Any = None
            ) -> torch.Tensor | None:
    """``einsum`` of an input and a weight (XLNet's ``einsum("ibh,hnd->ibnd", h, self.q)``),
    split: W computes dW by the einsum of the input and dY; None where the equation is not
    two plain operands (an ellipsis, a letter twice in one operand) or the weight has a
    letter that neither the input nor the output has."""
    ops = operands[0] if len(operands) == 1 and isinstance(operands[0], list | tuple) \
        else operands
    terms = _einsum_terms(equation, len(ops))
    if terms is None or _weight(ops[0]) == _weight(ops[1]):
        return None
    k = 1 if _weight(ops[1]) else 0
    (w_sub, x_sub), out = (terms[0][k], terms[0][1 - k]), terms[1]
    if not set(w_sub) <= set(x_sub) | set(out):
        return None
    back = f"{x_sub},{out}->{w_sub}"

    def native(x: torch.Tensor, w: torch.Tensor, _: Any) -> torch.Tensor:
        return aten.einsum(equation, [x, w] if k == 1 else [w, x])

    def wgrad_of(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, _: Any) -> None:
        accumulate(w, aten.einsum(back, [x, dy]))

    return split_product(work, native, ops[1 - k], ops[k], None, wgrad_of)


def _einsum_terms(equation: Any, n: int) -> tuple[tuple[str, str], str] | None:
    """The two operands' subscripts and the output's of an explicit ``einsum`` equation of
    ``n`` = 2 operands, each letter once per term; else None."""
    if not isinstance(equation, str) or n != 2 or "->" not in equation or "." in equation:
        return None
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != 2 or any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    return (terms[0], terms[1]), out


def _mm(work: WeightWork, x: Any, w: Any) -> torch.Tensor | None:
    return _product(work, x, w, aten.mm)


def _bmm(work: WeightWork, x: Any, w: Any) -> torch.Tensor | None:
    return _product(work, x, w, aten.bmm)


def _matmul(work: WeightWork, x: Any, w: Any) -> torch.Tensor | None:
    return _product(work, x, w, torch.matmul)


def _aten_embedding(work: WeightWork, w: Any, ids: torch.Tensor, padding_idx: int = -1,
                    scale_grad_by_freq: bool = False, sparse: bool = False
                    ) -> torch.Tensor | None:
    if sparse or not _weight(w):
        return None
    return split_embedding(ids, w, work, padding_idx, scale_grad_by_freq)


def _fn_embedding(work: WeightWork, ids: torch.Tensor, w: Any, padding_idx: int | None = None,
                  max_norm: float | None = None, norm_type: float = 2.0,
                  scale_grad_by_freq: bool = False, sparse: bool = False
                  ) -> torch.Tensor | None:
    if sparse or max_norm is not None or not _weight(w):
        return None
    pad = -1 if padding_idx is None else padding_idx % w.shape[0]
    return split_embedding(ids, w, work, pad, scale_grad_by_freq)


def _spread(v: Any, n: int) -> tuple[int, ...]:
    """A convolution argument (an int or a sequence) as one int per spatial dimension."""
    return tuple(int(i) for i in v) if isinstance(v, list | tuple) else (int(v),) * n


def _conv(work: WeightWork, x: torch.Tensor, w: Any, b: Any = None, stride: Any = 1,
          padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor | None:
    if not (_weight(w) and _weight_or_none(b)):
        return None
    n = w.dim() - 2
    steps, dilation = _spread(stride, n), _spread(dilation, n)
    numeric = wgrad_conv.numeric_padding(x, padding, tuple(w.shape[2:]), dilation, steps) \
        if isinstance(padding, str) else (x, _spread(padding, n))
    if numeric is None:
        return None
    return wgrad_conv.split_conv(numeric[0], w, b, work,
                            (steps, numeric[1], dilation, False, (0,) * n, groups))


def _convolution(work: WeightWork, x: torch.Tensor, w: Any, b: Any, stride: Any, padding: Any,
                 dilation: Any, transposed: bool, output_padding: Any, groups: int
                 ) -> torch.Tensor | None:
    if not transposed:
        return _conv(work, x, w, b, stride, padding, dilation, groups)
    return _conv_transpose(work, x, w, b, stride, padding, output_padding, groups, dilation)


def _conv_transpose(work: WeightWork, x: torch.Tensor, w: Any, b: Any = None, stride: Any = 1,
                    padding: Any = 0, output_padding: Any = 0, groups: int = 1,
                    dilation: Any = 1) -> torch.Tensor | None:
    """A transposed convolution (``conv_transpose2d``'s arguments, in its order)."""
    if not (_weight(w) and _weight_or_none(b)) or isinstance(padding, str):
        return None
    n = w.dim() - 2
    return wgrad_conv.split_conv(x, w, b, work, (_spread(stride, n), _spread(padding, n),
                                            _spread(dilation, n), True,
                                            _spread(output_padding, n), groups))


RULES: Mapping[Any, Rule] = {
    aten.linear.default: _linear, fn.linear: _linear,
    aten.addmm.default: _addmm, torch.addmm: _addmm,
    aten.mm.default: _mm, torch.mm: _mm,
    aten.bmm.default: _bmm, torch.bmm: _bmm,
    aten.einsum.default: _einsum, torch.einsum: _einsum,
    aten.matmul.default: _matmul, torch.matmul: _matmul, operator.matmul: _matmul,
    aten.embedding.default: _aten_embedding, fn.embedding: _fn_embedding,
    aten.conv1d.default: _conv, aten.conv2d.default: _conv, aten.conv3d.default: _conv,
    aten.conv1d.padding: _conv, aten.conv2d.padding: _conv, aten.conv3d.padding: _conv,
    fn.conv1d: _conv, fn.conv2d: _conv, fn.conv3d: _conv,
    aten.convolution.default: _convolution,
    aten.conv_transpose1d.default: _conv_transpose, aten.conv_transpose2d.input: _conv_transpose,
    aten.conv_transpose3d.input: _conv_transpose, fn.conv_transpose1d: _conv_transpose,
    fn.conv_transpose2d: _conv_transpose, fn.conv_transpose3d: _conv_transpose,
    aten.lstm.input: wgrad_rnn.aten_lstm, aten.gru.input: wgrad_rnn.aten_gru,
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
SPLITTING = frozenset(DEFERRING.values())
"""The deferring functions (a rewritten graph's products)."""


def rewrite(module: nn.Module) -> int:
    """Point every graph node of ``module`` (its own graph and its submodules') that calls an
    operation of ``RULES`` at the deferring version, and every experts' product at its
    ``wgrad_experts`` fusion, recompiling what changed; idempotent. Returns how many nodes
    were rewritten."""
    count = 0
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        changed = experts.fuse(graph) + _mark_computed(graph)
        for node in graph.nodes:
            if node.op == "call_function" and _hashable(node.target) in DEFERRING:
                node.target = DEFERRING[node.target]
                changed += 1
        if changed:
            _recompile(sub)
        count += changed
    return count


COMPUTED = "flexpipe_computed"
"""``node.meta`` key: the node's value is computed from the model's parameters and buffers
alone (set on the whole model's graph before it is cut, so that a stage's placeholder for such
a value keeps it)."""


def mark_computed(graph: fx.Graph) -> None:
    """Note in ``node.meta[COMPUTED]`` each node of ``graph`` computed from parameters and
    buffers alone (``get_attr``), no input: a weight the model computes (``_mark_computed``)."""
    for node in _parameter_only(graph):
        node.meta[COMPUTED] = True


def _parameter_only(graph: fx.Graph) -> set[fx.Node]:
    """The nodes of ``graph`` whose value reads parameters and buffers (``get_attr``, or a
    placeholder marked ``COMPUTED``) and nothing of the inputs."""
    only: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" or node.meta.get(COMPUTED) or (
                node.op in ("call_function", "call_method")
                and all(a in only for a in node.all_input_nodes)):
            only.add(node)
    return only


def _is_product(node: fx.Node) -> bool:
    target = _hashable(node.target)
    return node.op == "call_function" and (target in RULES or target in SPLITTING)


def _mark_computed(graph: fx.Graph) -> int:
    """Tag (``wgrad.computed_weight``) each product operand that the graph computes from its
    parameters alone (``weight_norm``'s ``g * v / |v|``, ``2 * self.w``, an expanded view),
    where nothing but products and such computations reads it: B then leaves its graph
    alone, and W differentiates through it. Returns how many operands were tagged."""
    only = _parameter_only(graph)
    private: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node in only and node.op not in ("get_attr", "placeholder") and node.users and all(
                u in private or _is_product(u) for u in node.users):
            private.add(node)
    count = 0
    for node in list(graph.nodes):
        if not _is_product(node):
            continue
        for arg in node.all_input_nodes:
            if arg in private and arg.target is not wgrad.computed_weight:
                with graph.inserting_before(node):
                    tag = graph.call_function(wgrad.computed_weight, (arg,))
                tag.meta.update(arg.meta)
                node.replace_input_with(arg, tag)
                count += 1
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
    work, weight, bias = wgrad.current(), self.weight, self.bias  # read once
    out = None if work is None or not wgrad.owned(weight, bias) \
        else _addmm(work, bias, flat, weight)
    if out is None:
        out = torch.addmm(bias, flat, weight)
    return out.view(size_out)


NAMED_FORWARDS: Mapping[str, Callable[..., Any]] = {
    "transformers.pytorch_utils.Conv1D": _hf_conv1d_forward,
}
"""Module class (``module.qualname``, so its library need not be imported) -> split forward."""
