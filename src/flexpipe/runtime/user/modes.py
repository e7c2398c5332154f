"""A traced model whose forward reads ``self.training``: one stage graph per mode.

A trace runs the forward once, so a branch on ``self.training`` (stochastic depth, train-only
input noise or heads, ``if self.training and self.use_checkpoint``) is frozen in the mode the
model was in. FlexPipe therefore traces the model in training mode and again in eval mode
(``graphs``); where the two graphs differ other than in the training flags of random
operations (which re-read the stage's mode as they run:
``flexpipe.runtime.user.randomness``), both are cut at the same split points and each stage
keeps its eval-mode piece next to its training one (``merge``): ``Pipeline.eval`` runs what
``model.eval()`` runs. The two cuts must pass the same values between stages; where they do
not, the model is refused, naming the module where the modes part.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import fx, nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import Segment
from flexpipe.runtime.user.randomness import DROP_P, TRAIN_ARG, keyed


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


def merge(train: Sequence[Segment], evaluated: Sequence[Segment], same_interface: bool,
          module: nn.Module, where: str) -> None:
    """Give each traced stage of ``train`` its eval-mode piece from ``evaluated`` (the same
    split points; ``same_interface``: whether both take and return the same); refused when
    the two cuts pass other values between stages."""
    refusal = ConfigError(
        f"{type(module).__name__} reads self.training in module {where!r}, and in eval mode "
        "its stages would pass other values to each other than in training: move the split "
        "points off the modules whose forward branches on self.training, or let both modes "
        "hand the same tensors across the split points")
    if not same_interface:
        raise refusal
    for ts, es in zip(train, evaluated, strict=True):
        a, b = ts.layers[0], es.layers[0]
        if (ts.after, ts.takes, ts.grads, _shape(a)) != (es.after, es.takes, es.grads, _shape(b)):
            raise refusal
        a.keep_eval(b)  # type: ignore[operator]


def _shape(stage: nn.Module) -> tuple[object, object]:
    """What a traced stage hands on: the values it picks, and whether its piece returns a
    tuple."""
    return getattr(stage, "outs", None), getattr(stage, "multi", None)
