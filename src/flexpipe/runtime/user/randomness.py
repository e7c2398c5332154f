"""Random numbers of a traced model that do not depend on where it is cut.

A built-in model's layers are seeded one by one (``flexpipe.runtime.execution.rng``); a traced
model's stage is one piece of graph, so seeding by stage would tie dropout masks to the split
points. Instead every random operation of the traced graph (dropout, ``bernoulli``, ``rand``,
...; a dropout module's call becomes its functional form) is keyed by where it is in the model:
the path of the module it runs in, the operation and its occurrence there
(``lm.model.layers.2.self_attn:aten.dropout#0``). With a seed, each draws from a generator
seeded by (seed, step, micro-batch, key): the masks are the same whatever the split points,
the schedule, the ranks or a recompute, and the same as in a one-process pipeline of the model
(``world`` of 1), the reference. Without a seed, the global generator runs on.

A graph records the training flag of a dropout as it was when it was traced (``torch.export``
bakes ``train=True`` into ``aten.dropout``); keyed dropouts take the flag of the stage running
them instead, so ``eval`` runs without dropout.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as fn

from flexpipe.runtime.execution.rng import layer_seed, seeded

aten = torch.ops.aten
RANDOM: dict[str, Callable[..., Any]] = {
    "aten.dropout": aten.dropout.default, "aten.native_dropout": aten.native_dropout.default,
    "aten.bernoulli": aten.bernoulli.default, "aten.bernoulli.p": aten.bernoulli.p,
    "aten.rand": aten.rand.default, "aten.randn": aten.randn.default,
    "aten.rand_like": aten.rand_like.default, "aten.randn_like": aten.randn_like.default,
    "torch.dropout": torch.dropout, "F.dropout": fn.dropout, "torch.bernoulli": torch.bernoulli,
    "torch.rand": torch.rand, "torch.randn": torch.randn,
    "torch.rand_like": torch.rand_like, "torch.randn_like": torch.randn_like,
    "F.dropout1d": fn.dropout1d, "F.dropout2d": fn.dropout2d, "F.dropout3d": fn.dropout3d,
    "F.alpha_dropout": fn.alpha_dropout, "F.feature_alpha_dropout": fn.feature_alpha_dropout,
    "aten.sdpa": aten.scaled_dot_product_attention.default,
    "F.sdpa": fn.scaled_dot_product_attention,
}
"""The random operations keyed, by a name the graph can carry."""
TRAIN_ARG = {"aten.dropout": 2, "aten.native_dropout": 2, "torch.dropout": 2, "F.dropout": 2,
             "F.dropout1d": 2, "F.dropout2d": 2, "F.dropout3d": 2, "F.alpha_dropout": 2,
             "F.feature_alpha_dropout": 2}
"""Where a dropout takes its training flag (positional index)."""
DROP_P = {"aten.sdpa": 4, "F.sdpa": 4}
"""Attention with dropout inside: where it takes ``dropout_p`` (0 outside training)."""
_NAMES = {id(op): name for name, op in RANDOM.items()}
MODULES: dict[type[nn.Module], str] = {
    nn.Dropout: "F.dropout", nn.Dropout1d: "F.dropout1d", nn.Dropout2d: "F.dropout2d",
    nn.Dropout3d: "F.dropout3d", nn.AlphaDropout: "F.alpha_dropout",
    nn.FeatureAlphaDropout: "F.feature_alpha_dropout"}
"""Dropout modules a graph calls, as the functional dropout they run."""

_TRAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("flexpipe_training",
                                                                 default=True)


@contextlib.contextmanager
def training(flag: bool) -> Iterator[None]:
    """Keyed dropouts inside run in training mode when ``flag`` (else they pass through)."""
    token = _TRAINING.set(flag)
    try:
        yield
    finally:
        _TRAINING.reset(token)


def keyed(key: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """Random operation ``name`` keyed ``key`` (see the module docstring)."""
    training_now = _TRAINING.get()
    if name in TRAIN_ARG:
        kw = "train" if name.startswith(("aten", "torch")) else "training"
        args, kwargs = _set_arg(args, kwargs, TRAIN_ARG[name], kw, training_now)
    if name in DROP_P and not training_now:
        args, kwargs = _set_arg(args, kwargs, DROP_P[name], "dropout_p", 0.0)
    seed = layer_seed(key)
    if seed is None:
        return RANDOM[name](*args, **kwargs)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    with seeded(seed, first.device if first is not None else torch.device("cpu")):
        return RANDOM[name](*args, **kwargs)


def _set_arg(args: tuple[Any, ...], kwargs: dict[str, Any], where: int, name: str,
             value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with the argument at position ``where`` (or keyword ``name`` when
    it was not given by position) set to ``value``."""
    if len(args) > where:
        return (*args[:where], value, *args[where + 1:]), kwargs
    return args, {**kwargs, name: value}


def key_random_ops(gm: fx.GraphModule) -> int:
    """Key every random operation of ``gm`` in place; how many there are."""
    counts: dict[str, int] = {}
    found = 0
    for node in list(gm.graph.nodes):
        name = _random_name(gm, node)
        if name is None:
            continue
        stack = node.meta.get("nn_module_stack", {})
        path = str(list(stack.values())[-1][0]) if stack else ""
        if node.op == "call_module":
            path = str(node.target)
        site = f"{path}:{name}"
        key = f"{site}#{counts.get(site, 0)}"
        counts[site] = counts.get(site, 0) + 1
        found += 1
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            node.op, node.kwargs = "call_function", {"p": float(getattr(module, "p", 0.5))}
        node.args, node.target = (key, name, *node.args), keyed
    gm.recompile()
    return found


def _random_name(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The ``RANDOM`` name of a random call (a dropout module's: its functional form)."""
    if node.op == "call_function":
        return _NAMES.get(id(node.target))
    if node.op == "call_module":
        return MODULES.get(type(gm.get_submodule(str(node.target))))
    return None
