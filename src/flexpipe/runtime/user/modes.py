"""A traced model whose forward reads ``self.training``: one stage graph per mode.

A trace runs the forward once, so a branch on ``self.training`` (stochastic depth, train-only
input noise or heads, ``if self.training and self.use_checkpoint``) is frozen in the mode the
model was in. FlexPipe therefore traces the model in training mode and again in eval mode
(``graphs``); where the two graphs differ other than in the training flags of random
operations (which re-read the stage's mode as they run:
``flexpipe.runtime.user.randomness``), both are cut at the same split points and each stage
keeps its eval-mode piece next to its training one (``merged``): ``Pipeline.eval`` runs what
``model.eval()`` runs. The two cuts must pass the same values between stages; where they do
not, the model is refused, naming the module where the modes part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torch import fx, nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.user.randomness import DROP_P, TRAIN_ARG, keyed

if TYPE_CHECKING:
    from flexpipe.runtime.user.tracing import Traced


@contextlib.contextmanager
def mode(module: nn.Module, train: bool) -> Iterator[None]:
    """Within: ``module`` in training mode (its submodules' own modes kept when it already is)
    or in eval mode; afterwards every submodule's mode is back."""
    saved = [(m, m.training) for m in module.modules()]
    if not (train and module.training):
        module.train(train)
    try:
        yield
    finally:
        for m, flag in saved:
            m.training = flag


def graphs(module: nn.Module, trace: Callable[[], fx.GraphModule]
           ) -> tuple[fx.GraphModule, fx.GraphModule | None, str]:
    """The model's graph traced in training mode, its eval-mode graph where it differs (else
    None), and the module path where they first differ ("" when they do not). ``trace``
    traces the model and keys its random operations."""
    with mode(module, True):
        train = trace()
    with mode(module, False):
        evaluated = trace()
    where = _parting(train, evaluated)
    return train, (evaluated if where else None), where


def _parting(a: fx.GraphModule, b: fx.GraphModule) -> str:
    """The module path of the first node where graphs ``a`` and ``b`` differ ("" if none)."""
    sa, sb = _signature(a), _signature(b)
    nodes = list(a.graph.nodes)
    for k, (x, y) in enumerate(zip([*sa, None], [*sb, None], strict=False)):
        if x != y:
            node = nodes[min(k, len(nodes) - 1)]
            stack = node.meta.get("nn_module_stack", {})
            path = [str(v[0]) for v in stack.values()]
            if node.op == "call_module":
                path.append(str(node.target))
            return path[-1] if path and path[-1] else "(the model itself)"
    return ""


def _signature(gm: fx.GraphModule) -> list[tuple[Any, ...]]:
    """Each node as (op, target, arguments with nodes by position); the training flags of
    keyed random operations (and attention dropout's probability) left out."""
    index = {n: k for k, n in enumerate(gm.graph.nodes)}

    def arg(a: object) -> object:
        if isinstance(a, fx.Node):
            return ("node", index[a])
        if isinstance(a, tuple | list):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, arg(v)) for k, v in a.items()))
        return repr(a)

    out = []
    for node in gm.graph.nodes:
        args, kwargs = list(node.args), dict(node.kwargs)
        if node.target is keyed:
            name = str(args[1])
            where = TRAIN_ARG.get(name, DROP_P.get(name))
            if where is not None and len(args) > where + 2:
                args[where + 2] = "mode"
            for kw in ("train", "training", "dropout_p"):
                kwargs.pop(kw, None)
        target = node.target if isinstance(node.target, str) else getattr(
            node.target, "__qualname__", repr(node.target))
        out.append((node.op, str(target), arg(tuple(args)), arg(kwargs)))
    return out


def merged(train: Traced, evaluated: Traced, module: nn.Module, where: str) -> Traced:
    """``train`` with each stage's eval-mode piece from ``evaluated`` (the same split points);
    refused when the two cuts pass other values between stages."""
    refusal = ConfigError(
        f"{type(module).__name__} reads self.training in module {where!r}, and in eval mode "
        "its stages would pass other values to each other than in training: move the split "
        "points off the modules whose forward branches on self.training, or let both modes "
        "hand the same tensors across the split points")
    from flexpipe.runtime.user.tracing import TracedStage  # the module that calls this one

    pairs = list(zip(train.segments, evaluated.segments, strict=True))
    if train.interface != evaluated.interface:
        raise refusal
    for ts, es in pairs:
        a, b = ts.layers[0], es.layers[0]
        if not (isinstance(a, TracedStage) and isinstance(b, TracedStage)):
            raise refusal
        if (ts.after, ts.takes, ts.grads, a.outs, a.multi) != \
                (es.after, es.takes, es.grads, b.outs, b.multi):
            raise refusal
        a.keep_eval(b)
    return train
