"""How a traced model is called and what it returns, the Hugging Face way included.

Inputs: the traced graph takes its inputs in one order (``Interface.inputs``: their names, the
forward's parameters or the keyword inputs it was exported with), so a batch given by keyword
(``input_ids=..., attention_mask=..., labels=...``) is put in that order; stage 0 takes them
and later stages get the ones they read over stage-graph edges.

Outputs: a model may return a tensor, a tuple, a dict or a ``ModelOutput``. Between stages only
tensors travel (the structure's leaves, in order); ``Interface.out_spec`` rebuilds the
structure where the loss is computed and where ``eval`` returns it. ``loss_for`` gives the
executor its ``loss_fn(*leaves, target)``: your loss function on the structured output and the
target, or, without one, the loss the model computes itself (its ``loss`` entry, from the
``labels`` it was given).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from flexpipe.errors import ConfigError

Tensors = tuple[torch.Tensor, ...]
Example = tuple[Tensors, dict[str, torch.Tensor]]
"""One micro-batch's inputs: positional, then keyword."""
LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Interface:
    """The names of a traced model's inputs in the order its graph takes them, and the
    structure of its outputs (None: a tensor or a flat tuple of tensors)."""

    inputs: tuple[str, ...] = ()
    out_spec: TreeSpec | None = None
    signature: tuple[tuple[tuple[int | None, ...], torch.dtype] | None, ...] = ()
    """Per input, the (shape, dtype) an exported graph was made for (a dimension it left
    free: None; an input it did not fix: None); empty for a graph traced without shapes."""


def as_inputs(x: object, what: str = "inputs") -> Tensors:
    """A tensor or a tuple/list of tensors as a tuple (a ``ConfigError`` otherwise)."""
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, tuple | list) and all(isinstance(t, torch.Tensor) for t in x):
        return tuple(x)
    raise ConfigError(f"{what} must be a tensor or a tuple of tensors, got "
                      f"{type(x).__name__}")


def as_example(example: object, what: str = "example inputs") -> Example:
    """A micro-batch's inputs as (positional, keyword): a tensor, a tuple/list of tensors, a
    dict of named tensors (keyword inputs), or such a (positional, keyword) pair."""
    if isinstance(example, tuple) and len(example) == 2 and isinstance(example[1], Mapping):
        return as_inputs(example[0], what), dict(as_example(example[1], what)[1])
    if isinstance(example, Mapping):
        bad = [k for k, v in example.items() if not isinstance(v, torch.Tensor)]
        if bad or not all(isinstance(k, str) for k in example):
            raise ConfigError(f"{what}: keyword inputs must map names to tensors "
                              f"({bad[0]!r} is a {type(example[bad[0]]).__name__})" if bad
                              else f"{what}: keyword input names must be strings")
        return (), dict(example)
    if isinstance(example, torch.Tensor | tuple | list):
        return as_inputs(example, what), {}
    raise ConfigError(f"{what} must be a tensor, a tuple of tensors or a dict of named "
                      f"tensors, got {type(example).__name__}")


def output_leaves(gm: fx.GraphModule) -> list[Any]:
    """The values a graph returns, flattened (a dict's or a ``ModelOutput``'s entries in
    order)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return list(tree_flatten(out)[0])


def interface_of(gm: fx.GraphModule, split: fx.GraphModule) -> Interface:
    """The interface of traced (or exported) graph ``gm``, cut into ``split``."""
    names = tuple(str(n.target) for n in gm.graph.nodes if n.op == "placeholder")
    info = getattr(gm.graph._codegen, "pytree_info", None)  # noqa: SLF001 - torch.export's
    spec = info.out_spec if info is not None and info.out_spec is not None else \
        tree_flatten(next(n for n in split.graph.nodes if n.op == "output").args[0])[1]
    return Interface(names, None if _flat(spec) else spec, _signature(gm))


def _signature(gm: fx.GraphModule) -> tuple[tuple[tuple[int | None, ...], torch.dtype] | None,
                                            ...]:
    """The (shape, dtype) of every input of ``gm`` that its graph fixed (``meta["val"]`` of an
    exported graph's placeholders); empty when none is known."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(isinstance(v, torch.Tensor) for v in vals):
        return ()
    return tuple((tuple(d if isinstance(d, int) else None for d in v.shape), v.dtype)
                 if isinstance(v, torch.Tensor) else None for v in vals)


def check_inputs(interface: Interface, xs: Sequence[torch.Tensor]) -> None:
    """Refuse one micro-batch's inputs ``xs`` that an exported graph cannot take: another
    number of inputs than it was exported with, another shape or dtype than the example's,
    by name (a graph traced without shapes, whose inputs may have defaults, is not checked)."""
    names = interface.inputs
    if not interface.signature:
        return
    if len(xs) != len(names):
        raise ConfigError(f"the model was traced with {len(names)} inputs {list(names)}, got "
                          f"{len(xs)}" + (" by position: give them by keyword (input_ids=...)"
                                          if len(xs) < len(names) else ""))
    for name, x, want in zip(names, xs, interface.signature, strict=False):
        if want is None:
            continue
        shape, dtype = want
        fits = x.dim() == len(shape) and all(w is None or w == g
                                             for w, g in zip(shape, x.shape, strict=True))
        if not fits or x.dtype != dtype:
            per = shape[0] if shape and shape[0] is not None else None
            raise ConfigError(
                f"input {name!r}: a micro-batch of shape {tuple(x.shape)} {x.dtype}, but the "
                f"model was exported on the example's {_shape(shape)} {dtype}: every "
                "micro-batch must have the example's shape and dtype"
                + (f" (a batch of m x {per} samples)" if per else ""))


def _shape(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"


def _flat(spec: TreeSpec) -> bool:
    """Whether ``spec`` is one leaf or a tuple/list of leaves (outputs passed as they are)."""
    return spec.is_leaf() or (spec.type in (tuple, list) and
                              all(c.is_leaf() for c in spec.children_specs))


def order_inputs(interface: Interface, named: Mapping[str, Any]) -> tuple[Any, ...]:
    """Keyword inputs in the order the graph takes them; an input the model was not traced
    with is refused by name, one it was traced with and not given is refused too."""
    if not interface.inputs:
        raise ConfigError("keyword inputs need a traced model (split points); a chain of "
                          "layers takes its inputs by position")
    unknown = sorted(set(named) - set(interface.inputs))
    missing = [n for n in interface.inputs if n not in named]
    if unknown or missing:
        raise ConfigError(f"the model was traced with inputs {list(interface.inputs)}; "
                          + (f"unknown: {unknown}" if unknown else f"missing: {missing}"))
    return tuple(named[n] for n in interface.inputs)


class StructuredLoss:
    """The executor's ``loss_fn(*leaves, target)`` for a model with structured outputs."""

    def __init__(self, spec: TreeSpec, loss_fn: LossFn | None) -> None:
        self.spec, self.loss_fn = spec, loss_fn

    def __call__(self, *args: Any) -> torch.Tensor:
        """Rebuild the output from its leaves, then your loss or the model's own."""
        *leaves, target = args
        out = tree_unflatten(list(leaves), self.spec)
        if self.loss_fn is not None:
            return self.loss_fn(out, target)
        loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise ConfigError("no loss_fn was given and the model's output has no 'loss': pass "
                              "the labels as an input (labels=...) or give loss_fn")
        return loss


def loss_for(interface: Interface, loss_fn: LossFn | None) -> LossFn:
    """What the executor calls with a sink stage's outputs and the target."""
    if interface.out_spec is not None:
        return StructuredLoss(interface.out_spec, loss_fn)
    if loss_fn is None:
        raise ConfigError("pipeline() needs loss_fn(*outputs, target): the model returns "
                          "tensors, not an output with its own 'loss'")
    return loss_fn


def gather(parts: Sequence[tuple[torch.Tensor, ...]], interface: Interface) -> Any:
    """The micro-batches' outputs as one batch: each leaf concatenated (a scalar, such as the
    model's loss, averaged), in the model's structure."""
    leaves = [torch.stack(ts).mean() if ts[0].dim() == 0 else torch.cat(ts)
              for ts in zip(*parts, strict=True)]
    if interface.out_spec is not None:
        return tree_unflatten(leaves, interface.out_spec)
    return leaves[0] if len(leaves) == 1 else tuple(leaves)
