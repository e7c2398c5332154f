"""One micro-batch's weight-gradient work on one stage: what B leaves for W.

While a split micro-batch records (``rule.recording``), every product that mixes an activation
with a trainable weight leaves a *link* here. In B (``backward_input``) a link computes only
the gradient of its activations and defers ``Pending``: the product's outputs (their graph into
the weights, kept since F), their gradients dY, and the weights' leaf parameters. W (``run``)
differentiates every pending product of the micro-batch in one ``torch.autograd.backward`` into
those parameters, then runs the closures of the fast path (``linear``), and drops what B held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

Closure = Callable[[], None]
WALK = 32
"""The most autograd nodes a computed weight's graph may have (weight norm: 1, spectral norm:
6); a longer graph is an activation's, not a weight's."""


@dataclass(eq=False)
class Pending:
    """One product's weight gradient left for W: where its outputs enter its graph (their
    gradient edges: the outputs themselves are not kept), their dY, its parameters."""

    outputs: list[GradientEdge]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    computed: list[tuple[int, ...]] = field(default_factory=list)
    """The shapes of the weights it computes from those parameters (an error names them)."""


@dataclass(eq=False)
class WeightWork:
    """One micro-batch's weight-gradient work on one stage (B -> W)."""

    deferring: bool = False
    """True during B: weight gradients are left in ``pending`` instead of computed."""
    pending: list[Pending | Closure] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    """Tensors held since F outside autograd's saved tensors (the fast path's inputs)."""
    deferred: dict[int, torch.Tensor] = field(default_factory=dict)
    """The parameters whose gradient this micro-batch's products leave to W (by id)."""
    known: set[int] = field(default_factory=set)
    """Ids of the autograd nodes of products' outputs: activations, whatever they reach."""
    computed: dict[int, torch.Tensor] = field(default_factory=dict)
    """Computed weights (a graph into parameters alone) a product read, by id."""
    held_fast: list[torch.Tensor] = field(default_factory=list)
    """The fast path's (input, dY) pairs held from B to W."""

    def note(self, params: Iterable[torch.Tensor]) -> None:
        """Note parameters whose gradient W computes (the stage's deferred share)."""
        self.deferred.update((id(p), p) for p in params)

    def defer(self, item: Pending | Closure, *held: torch.Tensor) -> None:
        """Keep ``item`` for W (and note the tensors a closure holds)."""
        self.pending.append(item)
        self.held_fast.extend(held)

    @property
    def held(self) -> list[torch.Tensor]:
        """What B left for W: the fast path's pairs, the pending dY and every tensor the
        pending products' graphs saved (memory accounting)."""
        out = list(self.held_fast)
        for item in (p for p in self.pending if isinstance(p, Pending)):
            out += item.grads + saved(item.outputs)
        return out

    def run(self) -> None:
        """W: every deferred weight gradient of the micro-batch, accumulated into the
        parameters (one backward over the pending products, then the closures), then drop
        what B kept."""
        links = [p for p in self.pending if isinstance(p, Pending)]
        if links:
            outs = [o for p in links for o in p.outputs]
            params = list({id(q): q for p in links for q in p.params}.values())
            try:
                torch.autograd.backward(outs, [g for p in links for g in p.grads],
                                        inputs=params)
            except RuntimeError as err:
                raise _freed(links, err) from err
        with torch.no_grad():
            for item in self.pending:
                if not isinstance(item, Pending):
                    item()
        for held in (self.pending, self.held_fast, self.kept):
            held.clear()
        self.computed.clear()

    @contextlib.contextmanager
    def backward_input(self) -> Iterator[None]:
        """Within: a backward through this work's products defers their weight gradients."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False


def _freed(links: list[Pending], err: RuntimeError) -> RuntimeError:
    """W's error when B freed a weight's graph (something other than a product read it)."""
    link = next((p for p in links if p.computed), links[0])
    shape = link.computed[0] if link.computed else tuple(link.params[0].shape)
    return RuntimeError(f"W: the weight of shape {shape} computed from parameters of shapes "
                        f"{[tuple(q.shape) for q in link.params]} could not be differentiated: "
                        "B freed its graph, so something other than a product also read it "
                        f"before the product did ({err})")


def trainable(t: object) -> bool:
    """A parameter that wants its gradient (never a stage input, a plain leaf)."""
    return isinstance(t, nn.Parameter) and t.requires_grad


def below(node: object, stop: set[int], limit: int = WALK) -> list[torch.Tensor] | None:
    """The trainable parameters an autograd graph from ``node`` reaches, when it reaches
    nothing else (no other leaf, no node in ``stop``) within ``limit`` nodes; else None."""
    seen: set[int] = set()
    found: dict[int, torch.Tensor] = {}
    stack = [node]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if id(node) in stop or len(seen) >= limit:
            return None
        seen.add(id(node))
        leaf = getattr(node, "variable", None)
        if leaf is not None:  # AccumulateGrad
            if not trainable(leaf):
                return None
            found[id(leaf)] = leaf
            continue
        stack.extend(n for n, _ in node.next_functions)  # type: ignore[attr-defined]
    return list(found.values()) or None


def saved(outputs: Iterable[GradientEdge]) -> list[torch.Tensor]:
    """Every tensor the graphs from ``outputs`` saved (each node's ``_saved_*``, a custom
    function's ``saved_tensors``)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack: list[Any] = [o.node for o in outputs]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or hasattr(node, "variable"):
            continue
        seen.add(id(node))
        for name in dir(node):
            if name.startswith("_saved_") or name == "saved_tensors":
                with contextlib.suppress(RuntimeError):
                    value = getattr(node, name)
                    out += [v for v in (value if isinstance(value, tuple | list) else [value])
                            if isinstance(v, torch.Tensor)]
        stack.extend(n for n, _ in node.next_functions)
    return out
