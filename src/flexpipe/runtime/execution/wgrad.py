"""The backward split (B / W) by a weight-gradient store.

``wsplit.prepare(module)`` gives the layers with weights inside ``module`` (``nn.Linear``,
``nn.Conv*``, ``nn.Embedding``, ``nn.EmbeddingBag``, ``nn.LSTM``/``nn.GRU``, the projections of
``nn.MultiheadAttention``: ``wgrad_layers``, ``wgrad_conv``, ``wgrad_bag``, ``wgrad_rnn``) a
forward that, while a ``WeightWork`` is recording (``recording(work)``, the forward of a
micro-batch that will be split), computes its products through this module (``split_product``,
``split_linear``) or an autograd function of its own. In that micro-batch's B
(``work.deferring``) such a function computes only its input gradient and leaves a closure in
the work holding what its weight gradient reads: the layer's input and its output gradient. W
(``work.run()``) runs the closures, one product per weight, accumulating into ``param.grad``.

B is then an ordinary backward without ``retain_graph``: the graph and every saved tensor that W
does not read are freed as B runs, nothing is analysed per micro-batch, and parameter-free ops
(and LayerNorm, whose weight gradient is a by-product of its input gradient) run once. A weight
computed from parameters alone (``weight_norm``, ``spectral_norm``, pruning, a cast:
``computed``) is split too: the product runs on a detached stand-in (``operand``), and W
differentiates the weight's own graph, kept since F, into the parameters (``accumulate``).
Parameters of modules not in the table (a user's own ``nn.Parameter`` added or multiplied
elementwise, a subclass with its own forward) get their gradient in B with the input gradient:
correct, not deferred (``deferred_share`` says how much of a stage's weights W handles).
Outside B — a fused BW, a single-device run — the functions compute every gradient at once, the
same arithmetic.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, overload

import torch
from torch import nn
from torch.nn import functional as fn

Closure = Callable[[], None]


class WeightWork:
    """One micro-batch's weight-gradient work on one stage: the closures B left for W."""

    def __init__(self) -> None:
        self.deferring = False
        """True during B: weight gradients are left in ``pending`` instead of computed."""
        self.pending: list[Closure] = []
        self.held: list[torch.Tensor] = []
        """The tensors the pending closures read (for memory accounting)."""
        self.kept: list[torch.Tensor] = []
        """Inputs kept since F outside autograd's saved tensors (for memory accounting)."""
        self.deferred: dict[int, torch.Tensor] = {}
        """The parameters whose gradient this micro-batch's split layers compute (by id)."""

    def note(self, *params: torch.Tensor | None) -> None:
        """Note parameters a split layer computes the gradient of (W's share of the stage):
        a view's parameter, a computed weight's parameters."""
        for p in params:
            if p is not None and p.requires_grad:
                for owner in _owners(p):
                    self.deferred[id(owner)] = owner

    def keep(self, t: torch.Tensor) -> None:
        """Note a tensor held since F for W (a split linear's input)."""
        self.kept.append(t)

    def defer(self, closure: Closure, *held: torch.Tensor) -> None:
        """Keep ``closure`` (and note the tensors it holds) for W."""
        self.pending.append(closure)
        self.held.extend(held)

    def run(self) -> None:
        """W: compute and accumulate every deferred weight gradient, then drop what B kept.
        Without grad mode: a product with a parameter operand (a convolution's backward takes
        the weight) would otherwise build a graph that ``param.grad`` keeps, with the
        micro-batch's input and output gradient, for the rest of the step."""
        with torch.no_grad():
            for closure in self.pending:
                closure()
        self.pending.clear()
        self.held.clear()
        self.kept.clear()

    @contextlib.contextmanager
    def backward_input(self) -> Iterator[None]:
        """Within: a backward through this work's layers defers their weight gradients."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False


_RECORDING: contextvars.ContextVar[WeightWork | None] = contextvars.ContextVar(
    "flexpipe_wgrad_recording", default=None)


def current() -> WeightWork | None:
    """The weight-gradient work the running forward reports to (None: plain layers)."""
    return _RECORDING.get()


@contextlib.contextmanager
def recording(work: WeightWork | None) -> Iterator[None]:
    """Run a forward whose split layers report to ``work`` (None: plain layers)."""
    token = _RECORDING.set(work)
    try:
        yield
    finally:
        _RECORDING.reset(token)


def trainable(t: object) -> bool:
    """A parameter that wants its gradient (never a stage input, which is a plain leaf): what
    a graph's product may defer to W."""
    return isinstance(t, nn.Parameter) and t.requires_grad


def weight_operand(t: object) -> bool:
    """A trainable parameter, a view of one in which no element appears twice (a
    transpose, a reshape, a squeeze, a slice: ``x @ self.weight.T``, Mamba's
    ``conv1d(x, weight.squeeze(1).unsqueeze(1))``), or a weight computed from parameters
    alone (``computed``): what a product may defer to W, which accumulates the view's
    gradient into the parameter's, or a computed weight's through its graph
    (``accumulate``)."""
    return trainable(t) or _viewed(t) is not None or hasattr(t, _PARAMS)


_PARAMS = "_flexpipe_params"
"""The attribute naming the parameters a computed weight is made of (``computed``)."""
_SOURCE = "_flexpipe_source"
"""The attribute of a stand-in (``operand``) naming the computed weight it stands for."""
_WALK = 32
"""The most autograd nodes a computed weight's graph may have (weight norm: 1, spectral
norm: 6); a longer graph is an activation's, not a weight's."""


def computed(t: object) -> bool:
    """Whether ``t`` is a weight computed from trainable parameters alone (``weight_norm``'s
    ``g * v / |v|``, spectral norm, pruning's ``weight * mask``, a cast, ``2 * self.w``): its
    graph reaches parameters only, within ``_WALK`` nodes. Tags ``t`` with them so that a
    product defers it (``weight_operand``). Only for a tensor known to be a weight (a
    layer's ``weight``, a graph node computed from no input): a first stage's activations
    are computed from its embeddings alone too."""
    if hasattr(t, _PARAMS):
        return True
    params = _leaves(t)
    if params is None:
        return False
    setattr(t, _PARAMS, params)
    return True


def computed_weight(t: Any) -> Any:
    """``t``, tagged as a computed weight while a store records (``computed``): what a
    rewritten graph calls on a product's operand that it computes from parameters alone."""
    if _RECORDING.get() is not None:
        computed(t)
    return t


def _leaves(t: object) -> tuple[nn.Parameter, ...] | None:
    """The trainable parameters ``t``'s graph reaches, if it reaches nothing else (no stage
    input, no leaf that is not a trainable parameter) within ``_WALK`` nodes; else None."""
    node = getattr(t, "grad_fn", None)
    if node is None:
        return None
    seen: set[int] = set()
    found: dict[int, nn.Parameter] = {}
    stack = [node]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if len(seen) > _WALK:
            return None
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            if not trainable(node.variable):
                return None
            found[id(node.variable)] = node.variable
            continue
        stack.extend(n for n, _ in node.next_functions)
    return tuple(found.values()) or None


def owned(*weights: torch.Tensor | None) -> bool:
    """Whether a layer's weights (its own attributes, so weights by construction) can be
    split: each None, frozen (no gradient to split: a bias-only fine-tune still defers its
    biases), a parameter, a view of one, or computed from parameters alone (the layer under
    ``weight_norm``, ``spectral_norm``, pruning or a parametrization)."""
    return all(w is None or not w.requires_grad or weight_operand(w) or computed(w)
               for w in weights)


@overload
def operand(t: torch.Tensor) -> torch.Tensor: ...


@overload
def operand(t: None) -> None: ...


def operand(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor a split product computes with for its weight ``t``: ``t`` itself (a
    parameter, a view of one), or for a computed weight a detached leaf standing for it, so
    that B's graph does not reach the weight's own graph (kept for W, which differentiates
    through it: ``accumulate``)."""
    if t is None or not hasattr(t, _PARAMS) or hasattr(t, _SOURCE) or _viewed(t) is not None:
        return t
    stand = t.detach().requires_grad_(True)
    setattr(stand, _SOURCE, t)
    setattr(stand, _PARAMS, getattr(t, _PARAMS))
    work = _RECORDING.get()
    if work is not None:
        work.keep(stand)  # the computed weight stays alive until W: counted
    return stand


def _owners(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The parameters whose gradient a weight operand's gives: a computed weight's, a view's
    parameter, the parameter itself."""
    base = _viewed(t)
    if base is not None:
        return (base,)
    params: tuple[torch.Tensor, ...] = getattr(t, _PARAMS, (t,))
    return params


def _viewed(t: object) -> nn.Parameter | None:
    """The trainable parameter of which ``t`` is a view that reads no element twice (of the
    same dtype, inside the parameter's elements), else None."""
    base = getattr(t, "_base", None)
    if not (isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
            and isinstance(base, nn.Parameter) and base.requires_grad
            and t.dtype == base.dtype and t.numel() > 0):
        return None
    first = t.storage_offset() - base.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    inside = 0 <= first and last < base.numel()
    return base if inside and _no_overlap(t) and _dense(base) else None


def _no_overlap(t: torch.Tensor) -> bool:
    """No two indices of ``t`` address the same storage element (strides nest, inner first)."""
    span = 1
    for n, s in sorted((d for d in zip(t.shape, t.stride(), strict=True) if d[0] > 1),
                       key=lambda d: d[1]):
        if s < span:
            return False
        span = s * n
    return True


def _dense(t: torch.Tensor) -> bool:
    """``t`` fills its storage span exactly (contiguous up to a permutation of its dims)."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return _no_overlap(t) and span == t.numel()


def _into_parameter(view: torch.Tensor, base: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``base`` from that of its ``view`` (zero where the view does not
    read): the view's elements written where they sit in the parameter."""
    whole = (torch.empty_like if view.numel() == base.numel() else torch.zeros_like)(
        base, memory_format=torch.preserve_format)
    offset = view.storage_offset() - base.storage_offset()
    whole.as_strided(view.shape, view.stride(), offset).copy_(grad)
    return whole


def accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add ``grad`` to ``param.grad`` as autograd's accumulation does (a product, then an add:
    the same rounding as a fused backward, so every schedule trains to the same bits; one
    fused multiply-add would be cheaper but rounds differently). ``param`` may be a view of
    a parameter (``weight_operand``): the parameter's gradient gets the view's."""
    if grad is None:
        return
    source = getattr(param, _SOURCE, None)
    if source is not None:
        _through(source, grad)
        return
    base = _viewed(param)
    if base is not None:
        param, grad = base, _into_parameter(param, base, grad)
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)


def _through(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """Differentiate a computed weight's graph (kept since F) by its gradient into its
    parameters' (kept: another product may read the same weight)."""
    try:
        torch.autograd.backward(weight, grad, retain_graph=True)
    except RuntimeError as err:
        raise RuntimeError(
            f"W: the weight of shape {tuple(weight.shape)} computed from parameters of shapes "
            f"{[tuple(p.shape) for p in getattr(weight, _PARAMS, ())]} could not be "
            "differentiated: B freed its graph, so something other than a product also read "
            f"it ({err})") from err


def finish(work: WeightWork, closure: Closure, *held: torch.Tensor) -> None:
    """In B: defer ``closure``; elsewhere (a fused backward) run it now."""
    if work.deferring:
        work.defer(closure, *held)
    else:
        closure()


def _linear_wgrad(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> None:
    """dW = dY^T X and db = sum dY, accumulated (the parameters that want them)."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    if weight.requires_grad:
        accumulate(weight, dy2.t().mm(x.reshape(-1, x.shape[-1])))
    if bias is not None and bias.requires_grad:
        accumulate(bias, dy2.sum(0))


WGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], None]


class OutputHook:
    """On a split product's output (a linear layer's, or a graph's matrix product): receives
    its gradient dY in B and defers ``wgrad(dY, X, W, b)`` (from the input X kept since F) to
    W."""

    def __init__(self, work: WeightWork, x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, wgrad: WGrad = _linear_wgrad,
                 also: tuple[torch.Tensor, ...] = ()) -> None:
        self.work, self.x, self.weight, self.bias, self.wgrad = work, x, weight, bias, wgrad
        self.also = also
        """Further tensors ``wgrad`` reads (a gather's indices), held for W like X."""

    def __call__(self, dy: torch.Tensor) -> None:
        x, weight, bias, wgrad = self.x, self.weight, self.bias, self.wgrad
        dy = dy.detach()
        finish(self.work, lambda: wgrad(dy, x, weight, bias), x, dy, *self.also)


Native = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""A product ``native(x, W, b)``."""


def split_product(work: WeightWork, native: Native, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, wgrad_of: WGrad) -> torch.Tensor:
    """``native(x, W, b)``, a product of an input and a weight, with its weight gradient
    through ``work`` (``wgrad_of``: how W computes it from dY and X). Autograd runs the native
    op on the detached weight, so it computes and saves only what dX needs, and a hook on the
    output hands dY over; a non-contiguous input of more than two dimensions is made
    contiguous first (one product over all rows, not a batched one per leading index).
    Where the input carries no graph (XLNet's relative positions times ``self.r``), the
    product's one gradient is the weight's, through an autograd function."""
    weight, bias = operand(weight), operand(bias)
    if x.dim() > 2 and not x.is_contiguous():
        x = x.contiguous()
    xd = x.detach()
    work.keep(xd)
    if not x.requires_grad:
        return _WeightOnly.apply(xd, weight, bias, work, native,  # type: ignore[no-any-return]
                                 wgrad_of)
    y = native(x, weight.detach(), None if bias is None else bias.detach())
    work.note(weight, bias)
    y.register_hook(OutputHook(work, xd, weight, bias, wgrad_of))
    return y


class _WeightOnly(torch.autograd.Function):
    """A product of an input without a graph: its backward only hands dY to the weight's
    gradient (now, or in W)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                work: WeightWork, native: Native, wgrad_of: WGrad) -> torch.Tensor:
        ctx.hook = OutputHook(work, x, weight, bias, wgrad_of)
        work.note(weight, bias)
        return native(x, weight.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, ...]:
        ctx.hook(dy)
        return None, None, None, None, None, None


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 work: WeightWork) -> torch.Tensor:
    """``F.linear`` whose weight gradient goes through ``work`` (``split_product``)."""
    wants = weight.requires_grad or (bias is not None and bias.requires_grad)
    if not wants:
        return fn.linear(x, weight, bias)
    return split_product(work, fn.linear, x, weight, bias, _linear_wgrad)
