"""The one rule of the B/W split: a product of an activation and a trainable weight.

While a micro-batch that will be split records (``recording(work)``), one
``TorchFunctionMode`` (``Products``) sees every torch call of the forward, whether it comes from
``nn.Linear``, a user module's ``torch.einsum``, an fx node or an exported graph's ``aten``
overload. A call of a product (``PRODUCTS`` by function, ``OPERATORS`` by operator name) whose
tensors include an *activation* and a *weight* (``role``) runs on leaf copies of its
activations, and a ``_Bridge`` joins its outputs to the stage's graph. In B the bridge takes the
gradient of the copies only (``autograd.grad``, the product's graph kept) and leaves a
``work.Pending`` for W; outside B (a fused backward) it takes every gradient at once, the same
arithmetic. torch's own derivatives then handle views, computed weights (weight norm, spectral
norm, casts, pruning, gathered experts), padded and transposed convolutions, bags and recurrent
layers. Everything else runs untouched: a parameter read outside a product gets its gradient in
B, correct and reported (``notice``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge
from torch.nn import functional as fn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from flexpipe.runtime.split import linear
from flexpipe.runtime.split.work import Pending, WeightWork, below, trainable

T = torch.Tensor
PRODUCTS: frozenset[Callable[..., Any]] = frozenset({
    torch._C._nn.linear, fn.bilinear, torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm,
    T.mm, torch.bmm, T.bmm, torch.addmm, T.addmm, torch.baddbmm, T.baddbmm, torch.einsum,
    torch.mv, T.mv, torch.addmv, torch.addbmm, torch.tensordot, torch.inner, torch.outer,
    fn.conv1d, fn.conv2d, fn.conv3d, fn.conv_transpose1d, fn.conv_transpose2d,
    fn.conv_transpose3d, fn.embedding, fn.embedding_bag,
    torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu,
    *([fn.grouped_mm] if hasattr(fn, "grouped_mm") else []),
    *([torch._grouped_mm] if hasattr(torch, "_grouped_mm") else []),
})
"""The products by torch function or Tensor method (``nn.MultiheadAttention``'s projections
are its ``linear`` calls: ``attention``)."""
OPERATORS = frozenset({f"aten::{n}" for n in (
    "linear matmul mm bmm addmm baddbmm einsum mv bilinear convolution conv1d conv2d conv3d "
    "conv_transpose1d conv_transpose2d conv_transpose3d embedding embedding_bag _embedding_bag "
    "lstm gru _grouped_mm").split()} | {"transformers::grouped_mm_fallback"})
"""The products by operator name (an exported graph's overloads, a library's custom op)."""
ACTIVATION, WEIGHT, DATA, OTHER = "activation", "weight", "data", "other"


_SEEN: dict[Any, bool] = {}
"""``is_product`` of every function the mode has seen (it sees every call of a forward)."""


def is_product(func: Any) -> bool:
    """Whether ``func`` (a torch function, a Tensor method, an operator overload) is a product."""
    try:
        return _SEEN[func]
    except KeyError:
        schema = getattr(func, "_schema", None)
        _SEEN[func] = found = func in PRODUCTS or (schema is not None and
                                                   schema.name in OPERATORS)
        return found
    except TypeError:  # not hashable
        return False


def role(work: WeightWork, t: object) -> str:
    """What ``t`` is to a product: a ``WEIGHT`` (a trainable parameter, or a tensor whose graph
    reaches trainable parameters alone within ``work.WALK`` nodes and no product's output),
    an ``ACTIVATION`` (anything else that wants a gradient), ``DATA`` (a tensor without
    one: token ids, a first stage's inputs) or ``OTHER`` (not a tensor)."""
    if not isinstance(t, torch.Tensor):
        return OTHER
    if not t.requires_grad:
        return DATA
    if trainable(t):
        return WEIGHT
    node = t.grad_fn
    if node is None or id(node) in work.known:
        return ACTIVATION
    return WEIGHT if below(node, work.known) is not None else ACTIVATION


def owners(t: torch.Tensor, work: WeightWork) -> list[torch.Tensor]:
    """The parameters a weight's gradient reaches (itself, or a computed weight's)."""
    if trainable(t):
        return [t]
    work.computed[id(t)] = t
    return below(t.grad_fn, work.known) or []


class _Link:
    """One split product: its outputs' graph from leaf copies of its activations."""

    def __init__(self, work: WeightWork, outs: list[torch.Tensor], copies: list[torch.Tensor],
                 params: list[torch.Tensor], computed: list[tuple[int, ...]]) -> None:
        self.work, self.outs, self.copies, self.params = work, outs, copies, params
        self.computed = computed  # the shapes of the computed weights among its operands

    def backward(self, dys: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the activations and (outside B) of the parameters; in B the
        parameters' are left to W."""
        pairs = [(o, d) for o, d in zip(self.outs, dys, strict=True) if d is not None]
        outs, grads = [o for o, _ in pairs], [d for _, d in pairs]
        defer = self.work.deferring
        targets = self.copies if defer else self.copies + self.params
        got: list[torch.Tensor | None] = [None] * len(targets)
        if outs and targets:
            got = list(torch.autograd.grad(outs, targets, grads, retain_graph=True,
                                           allow_unused=True))
        if defer and outs:
            edges = [get_gradient_edge(o) for o in outs]
            self.work.defer(Pending(edges, grads, self.params, self.computed))
        return tuple(got) + ((None,) * len(self.params) if defer else ())


class _Bridge(torch.autograd.Function):
    """Joins a split product's outputs (values computed apart) to the stage's graph: inputs
    the activations and the product's parameters, outputs the product's."""

    @staticmethod
    def forward(ctx: Any, link: _Link, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.link = link
        return tuple(o.detach() for o in link.outs)

    @staticmethod
    def backward(ctx: Any, *dys: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        link, ctx.link = ctx.link, None  # the product's graph lives on only in W's pending
        return (None, *link.backward(dys))


def split(work: WeightWork, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)``, its weights' gradient through ``work`` when it mixes an
    activation with a weight (else the plain call)."""
    fast = linear.fast(work, func, args, kwargs)  # before the roles: no graph walk
    if fast is not None:
        return _known(work, fast)
    flat, rebuild = _flatten(args, kwargs)
    roles = [role(work, t) for t in flat]
    if WEIGHT not in roles or not ({ACTIVATION, DATA} & set(roles)):
        return func(*args, **kwargs)
    copies = {i: flat[i].detach().requires_grad_() for i, r in enumerate(roles)
              if r == ACTIVATION}
    params = list({id(q): q for i, r in enumerate(roles) if r == WEIGHT
                   for q in owners(flat[i], work)}.values())
    inner_args, inner_kwargs = rebuild([copies.get(i, t) for i, t in enumerate(flat)])
    out = func(*inner_args, **inner_kwargs)
    leaves, out_spec = tree_flatten(out)
    slots = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not slots:
        return out
    work.note(params)
    acts = [flat[i] for i in copies]
    computed = [tuple(flat[i].shape) for i, r in enumerate(roles)
                if r == WEIGHT and not trainable(flat[i])]
    link = _Link(work, [leaves[i] for i in slots], list(copies.values()), params, computed)
    joined = _Bridge.apply(link, *acts, *params)
    for i, t in zip(slots, joined, strict=True):
        leaves[i] = t
    out = tree_unflatten(leaves, out_spec)
    if acts or any(leaves[i].dim() > 1 for i in slots):  # W v (spectral norm): a weight
        _known(work, out)
    return out


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[list[Any], Callable[[list[Any]], tuple[tuple[Any, ...], dict[str, Any]]]]:
    """The leaves of a call's arguments, and how to put new leaves back in their place
    (without pytree where no argument is a container: the common, cheap case)."""
    if any(isinstance(a, list | tuple | dict) for a in (*args, *kwargs.values())):
        flat, spec = tree_flatten((args, kwargs))
        return flat, lambda leaves: tree_unflatten(leaves, spec)  # type: ignore[no-any-return]
    n, keys = len(args), list(kwargs)
    return [*args, *kwargs.values()], \
        lambda leaves: (tuple(leaves[:n]), dict(zip(keys, leaves[n:], strict=True)))


def _known(work: WeightWork, out: Any) -> Any:
    """``out``, its tensors' nodes noted as activations' (a product's output is never a
    weight, even one computed from an embedding alone)."""
    for t in ([out] if isinstance(out, torch.Tensor) else tree_flatten(out)[0]):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            work.known.add(id(t.grad_fn))
    return out


def _reads(work: WeightWork, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call that is not a product, where it reads a computed weight a product read: that
    weight through an identity link, so that B leaves its gradient to W as well (its graph,
    shared with the product, must live until W)."""
    flat, rebuild = _flatten(args, kwargs)
    hits = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)
            and id(t) in work.computed and work.computed[id(t)] is t]
    if not hits:
        return func(*args, **kwargs)
    for i in hits:
        w = flat[i]
        params = owners(w, work)
        link = _Link(work, [w], [], params, [tuple(w.shape)])
        flat[i] = _known(work, _Bridge.apply(link, *params)[0])
    new_args, new_kwargs = rebuild(flat)
    return func(*new_args, **new_kwargs)


class Products(TorchFunctionMode):
    """Sees every torch call of a recording forward; splits the products (``split``)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            kwargs = {}
        product = _SEEN.get(func)  # the common case first: a call seen before, no product
        work = _STATE.work
        if work is None or not (product or work.computed or product is None):
            return func(*args, **kwargs)
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)
        if product or (product is None and is_product(func)):
            return split(work, func, args, kwargs)
        if work.computed:
            return _reads(work, func, args, kwargs)
        return func(*args, **kwargs)


class _State(threading.local):
    work: WeightWork | None = None
    depth: int = 0


_STATE = _State()


def current() -> WeightWork | None:
    """The weight-gradient work the running forward reports to (None: plain products)."""
    return _STATE.work


@contextlib.contextmanager
def recording(work: WeightWork | None) -> Iterator[None]:
    """Run a forward whose products report to ``work`` (None: plain products); the mode is
    pushed once per thread however deep the recordings nest."""
    before = _STATE.work
    _STATE.work = work
    mode = Products() if _STATE.depth == 0 and work is not None else None
    _STATE.depth += mode is not None
    try:
        with mode if mode is not None else contextlib.nullcontext():
            yield
    finally:
        _STATE.depth -= mode is not None
        _STATE.work = before
