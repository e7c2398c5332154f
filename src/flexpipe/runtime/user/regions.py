"""What a trace of the model must keep as the model wrote it: its own ``torch.autograd.Function``s
and its ``torch.autocast`` regions.

``torch.fx`` traces through a custom Function (a gradient reversal, a straight-through
estimator): its forward becomes plain operations and autograd of those replaces the backward
the user wrote. While FlexPipe traces a model, ``kept`` makes each ``Function.apply`` on traced
values one node of the graph that calls the user's Function when the stage runs, so its own
backward runs in the pipeline. ``torch.fx`` also runs a ``with torch.autocast(...)`` block (or
an ``@torch.autocast`` forward) at trace time only, leaving plain float32 operations; ``kept``
records the region's entry and exit as graph nodes (``torch.amp._enter_autocast`` /
``_exit_autocast``, what ``torch.export`` records for the same region), and ``close_regions``
closes a region at the end of each stage it spans and opens it again at the start of the next
one, so each stage computes under the autocast the model asked for.

``torch.export`` keeps an autocast region whole (one ``wrap_with_autocast`` node) but traces
through a custom Function as ``torch.fx`` would: ``functions_refused`` names the Function and
the module that calls it, and what to do instead. A schedule with a separate W pass is refused
for a model with autocast regions (``refuse_split``): the W pass's weight-gradient products do
not follow autocast's casts.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.autograd import function as autograd_function
from torch.utils import _pytree as pytree

from flexpipe.errors import ConfigError

ENTER, EXIT = torch.amp._enter_autocast, torch.amp._exit_autocast  # noqa: SLF001 - export's own
WRAPPED = torch.ops.higher_order.wrap_with_autocast
"""An autocast region as torch.export records it."""


def _traced(values: Any) -> fx.Proxy | None:
    """The first traced value among ``values`` (nested), if any."""
    return next((v for v in pytree.tree_leaves(values) if isinstance(v, fx.Proxy)), None)


def calling(fn: type) -> Any:
    """The graph target that applies Function ``fn`` (its own forward and backward)."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        return fn.apply(*args, **kwargs)  # type: ignore[attr-defined]

    apply.__name__ = apply.__qualname__ = f"{fn.__name__}_apply"
    return apply


@contextlib.contextmanager
def kept(tracer: fx.Tracer) -> Iterator[None]:
    """Within, while ``tracer`` traces: every custom Function applied to traced values is one
    node (``calling``) and every autocast region's entry and exit are nodes (module docstring).
    Calls on values that are not traced run as before."""
    base = autograd_function.Function
    apply = base.__dict__["apply"]
    enter, leave = torch.amp.autocast.__enter__, torch.amp.autocast.__exit__
    targets: dict[type, Any] = {}

    def applied(cls: type, *args: Any, **kwargs: Any) -> Any:
        if _traced((args, kwargs)) is None:
            return apply.__func__(cls, *args, **kwargs)
        target = targets.setdefault(cls, calling(cls))
        return tracer.create_proxy("call_function", target, args, kwargs)

    def entered(self: Any) -> Any:
        self._flexpipe_region = tracer.create_proxy(  # noqa: SLF001 - our own mark
            "call_function", ENTER,
            (self.device, self.fast_dtype, self._enabled, self._cache_enabled), {})
        return self

    def left(self: Any, *exc: Any) -> bool:
        region = getattr(self, "_flexpipe_region", None)
        if region is None:
            return bool(leave(self, *exc))
        tracer.create_proxy("call_function", EXIT, (region,), {})
        return False

    base.apply = classmethod(applied)  # type: ignore[assignment,method-assign]
    torch.amp.autocast.__enter__ = entered  # type: ignore[method-assign]
    torch.amp.autocast.__exit__ = left  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        base.apply = apply  # type: ignore[method-assign]
        torch.amp.autocast.__enter__ = enter  # type: ignore[method-assign]
        torch.amp.autocast.__exit__ = leave  # type: ignore[method-assign]


def close_regions(graph: fx.Graph, stage_of: dict[fx.Node, int]) -> None:
    """Where an autocast region spans a stage boundary: exit it as the earlier stage ends and
    enter it again as the later one starts (the new nodes get their stages in ``stage_of``),
    so no stage hands an open region to another."""
    open_: list[fx.Node] = []  # the entry node each open region's exit uses now
    again: dict[fx.Node, fx.Node] = {}
    stage = 0
    for node in list(graph.nodes):
        here = stage_of.get(node, stage)
        if here != stage and open_:
            with graph.inserting_before(node):
                for region in reversed(open_):
                    stage_of[graph.call_function(EXIT, (region,))] = stage
                fresh = [graph.call_function(ENTER, r.args) for r in open_]
            for old, new in zip(list(open_), fresh, strict=True):
                stage_of[new] = here
                again[old] = new
            open_ = fresh
        stage = here
        if node.op == "call_function" and node.target is ENTER:
            open_.append(node)
        elif node.op == "call_function" and node.target is EXIT:
            region = node.args[0]
            while region in again:
                region = again[region]
            node.args = (region,)
            open_.remove(region)  # type: ignore[arg-type]


def _module_path(root: nn.Module) -> str:
    """The path of the innermost module of ``root`` whose code is running (the caller's)."""
    paths = {id(m): name for name, m in root.named_modules()}
    frame = sys._getframe(2)  # noqa: SLF001 - the one way to see who calls
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            return paths[id(owner)] or "(the model itself)"
        frame = frame.f_back  # type: ignore[assignment]
    return "(outside the model's modules)"


@contextlib.contextmanager
def functions_refused(root: nn.Module) -> Iterator[None]:
    """Within (while ``torch.export`` runs ``root``): note every custom Function it applies
    (not torch's own: the Function of a ``torch.library`` custom op's autograd runs inside
    the op, which torch.export keeps whole); afterwards, a ``ConfigError`` naming the first and
    the module calling it."""
    base = autograd_function.Function
    apply = base.__dict__["apply"]
    found: list[tuple[str, str]] = []

    def noted(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.split(".")[0] != "torch":  # torch's own: a custom op's autograd
            found.append((cls.__qualname__, _module_path(root)))
        return apply.__func__(cls, *args, **kwargs)

    base.apply = classmethod(noted)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        base.apply = apply  # type: ignore[method-assign]
    if found:
        name, path = found[0]
        raise ConfigError(
            f"{type(root).__name__} applies the custom torch.autograd.Function {name} in module "
            f"{path!r}, which torch.fx cannot trace the model around and torch.export traces "
            "through (its backward would be replaced by autograd of its forward): make the "
            "model traceable by torch.fx (FlexPipe keeps the Function whole there), or wrap it "
            "as a torch.library.custom_op with register_autograd (torch.export keeps custom "
            "ops whole)")


def autocast_site(piece: nn.Module) -> str | None:
    """The module path of the first autocast region a stage's graph enters (torch.fx's entry
    node or torch.export's ``wrap_with_autocast``), or None."""
    graph = getattr(piece, "graph", None)
    for node in graph.nodes if isinstance(graph, fx.Graph) else ():
        if node.op == "call_function" and (node.target is ENTER or node.target is WRAPPED):
            stack = node.meta.get("nn_module_stack", {})
            return str(list(stack.values())[-1][0]) if stack else "(the model itself)"
    return None


def hidden_in_regions(gm: fx.GraphModule) -> str:
    """Why a split point may not be found: inside an autocast region torch.export kept whole
    ("" when ``gm`` has none)."""
    if any(n.target is WRAPPED for n in gm.graph.nodes):
        return ("; torch.export keeps each torch.autocast region as one operation, so a split "
                "point cannot be inside one")
    return ""


def refuse_split(layers: Iterable[nn.Module], kinds: set[str]) -> None:
    """Refuse a schedule with a separate weight-gradient pass (``W``) for a model computing
    under autocast: the W pass's products do not follow autocast's casts."""
    if "W" not in kinds:
        return
    for layer in layers:
        site = autocast_site(getattr(layer, "piece", layer))
        if site is not None:
            raise ConfigError(
                f"the model computes under torch.autocast (a region in module {site!r}), and "
                "the schedule splits the backward into B and W, whose weight-gradient products "
                "do not follow autocast's casts: use a schedule without a W pass (1f1b, "
                "gpipe, interleaved-1f1b) or remove the autocast")
