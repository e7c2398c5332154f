"""A model's own activation checkpointing while FlexPipe traces it into stages: the modules it
checkpoints become regions of selective recompute (``flexpipe.runtime.user.recompute``).

``torch.export`` records the grad mode it runs under, and a reentrant checkpoint
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, what Hugging Face's
``gradient_checkpointing_enable()`` uses unless told otherwise) runs its function under
``no_grad``: exported so, the checkpointed blocks would compute without a graph, and nothing in
or before them would get a gradient. A non-reentrant checkpoint traced as it runs would have its
recompute dropped. While FlexPipe traces a model, ``checkpointed`` turns off the
``gradient_checkpointing`` flag of Hugging Face's layers and lets every checkpoint call its
function directly, so the graph is the plain one with every gradient, and notes what was
checkpointed: each flagged layer and the module whose forward (or ``__call__``) a checkpoint
runs. Those modules are what SR then drops and recomputes, as the checkpoints would have. A
checkpoint of a function that is no module's is traced through, with a warning (its stages keep
those activations). The model is left as it was."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as checkpointing
from torch import nn

WARNING = ("the model checkpoints {n} functions that are no module's forward; FlexPipe traces "
           "through them, so its stages keep those activations: checkpoint a module (or select "
           "it with recompute=Recompute(drop=...)) to have them recomputed")


def owner(root: nn.Module, function: Callable[..., Any]) -> str | None:
    """The path in ``root`` of the module whose forward ``function`` runs (the module, a bound
    method of it, or a partial of either or of ``(forward, module)``, as Hugging Face's layers
    checkpoint), or None (a function of no submodule of ``root``)."""
    paths = {id(m): name for name, m in root.named_modules() if name}
    while isinstance(function, functools.partial):
        first = function.args[0] if function.args else None
        if id(first) in paths and getattr(function.func, "__self__", None) is None:
            return paths[id(first)]
        function = function.func
    bound = function if isinstance(function, nn.Module) else getattr(function, "__self__", None)
    return paths.get(id(bound))


@contextlib.contextmanager
def checkpointed(module: nn.Module) -> Iterator[list[str]]:
    """Within: ``module``'s checkpoints run as plain calls (see the module's docstring); the list
    yielded fills with the paths of the modules they checkpoint. Afterwards the layers' flags
    are back."""
    layers = [(name, m) for name, m in module.named_modules()
              if getattr(m, "gradient_checkpointing", None) is True]
    found = [name for name, _ in layers]
    loose: list[int] = []

    def note(function: Callable[..., Any], *args: Any) -> None:
        path = owner(module, function)
        if path is None:
            loose.append(1)
        elif path not in found:
            found.append(path)

    stand_ins = {"CheckpointFunction": _direct(note),
                 "_checkpoint_without_reentrant_generator": _plain(note)}
    saved = {name: getattr(checkpointing, name) for name in stand_ins}
    _set([m for _, m in layers], False)
    for name, value in stand_ins.items():
        setattr(checkpointing, name, value)
    try:
        yield found
    finally:
        for name, value in saved.items():
            setattr(checkpointing, name, value)
        _set([m for _, m in layers], True)
    if loose:
        warnings.warn(WARNING.format(n=len(loose)), UserWarning, stacklevel=3)


def _set(layers: list[nn.Module], on: bool) -> None:
    for layer in layers:
        setattr(layer, "gradient_checkpointing", on)  # noqa: B010 - a library's flag


def _direct(note: Callable[..., None]) -> type:
    """A stand-in for torch's reentrant ``CheckpointFunction``: notes and calls the function."""

    class Direct:
        @staticmethod
        def apply(function: Callable[..., Any], preserve: bool, *args: Any) -> Any:
            note(function)
            return function(*args)

    return Direct


def _plain(note: Callable[..., None]) -> Callable[..., Any]:
    """A stand-in for torch's non-reentrant checkpoint generator: notes the function, then
    lets ``checkpoint`` call it without hooks."""

    def generator(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
        note(function)
        yield

    return generator
