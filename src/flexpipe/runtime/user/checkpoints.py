"""A model's own activation checkpointing while FlexPipe traces it into stages.

``torch.export`` records the grad mode it runs under, and a reentrant checkpoint
(``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``, what Hugging Face's
``gradient_checkpointing_enable()`` uses unless told otherwise) runs its function under
``no_grad``: exported so, the checkpointed blocks compute without a graph, and nothing in or
before them gets a gradient (a GPT-2 with gradient checkpointing, under ZB-H1 at 2 ranks,
trained none of its parameters, without an error). A non-reentrant checkpoint is traced
through, its recompute dropped. While FlexPipe traces a model, ``traced_through`` turns off
the ``gradient_checkpointing`` flag of Hugging Face's layers and lets a reentrant checkpoint
call its function directly, so the graph is the plain one with every gradient, and warns
once that the stages keep the activations the checkpoints would have dropped (the profile
and the memory prediction count them; a schedule's recompute, ``1f1b-recompute`` or
``selective=True``, trades time for memory instead). The model is left as it was."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.checkpoint as checkpointing
from torch import nn

WARNING = ("the model checkpoints activations ({what}); FlexPipe traces through the "
           "checkpoints, so its stages keep those activations (the profile and the memory "
           "prediction count them): for recompute, use a schedule that recomputes "
           "('1f1b-recompute', or selective=True)")


@contextlib.contextmanager
def traced_through(module: nn.Module) -> Iterator[None]:
    """Within: ``module``'s checkpoints run as plain calls (see the module's docstring);
    afterwards its layers' flags are back and one warning names what was checkpointed."""
    layers = [m for m in module.modules() if getattr(m, "gradient_checkpointing", None) is True]
    calls: list[str] = []
    stand_ins = {  # what torch.utils.checkpoint.checkpoint looks up when it is called
        "CheckpointFunction": _direct(calls),
        "_checkpoint_without_reentrant_generator": _noted(
            calls, checkpointing._checkpoint_without_reentrant_generator)}
    saved = {name: getattr(checkpointing, name) for name in stand_ins}
    _set(layers, False)
    for name, value in stand_ins.items():
        setattr(checkpointing, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(checkpointing, name, value)
        _set(layers, True)
    what = ([f"gradient_checkpointing on {len(layers)} layers"] if layers else []) + \
        ([f"{len(calls)} torch.utils.checkpoint calls"] if calls else [])
    if what:
        warnings.warn(WARNING.format(what=", ".join(what)), UserWarning, stacklevel=3)


def _set(layers: list[nn.Module], on: bool) -> None:
    for layer in layers:
        setattr(layer, "gradient_checkpointing", on)  # noqa: B010 - a library's flag


def _direct(calls: list[str]) -> type:
    """A stand-in for torch's reentrant ``CheckpointFunction``: calls the function."""

    class Direct:
        @staticmethod
        def apply(function: Callable[..., Any], preserve: bool, *args: Any) -> Any:
            calls.append("reentrant")
            return function(*args)

    return Direct


def _noted(calls: list[str], generator: Callable[..., Any]) -> Callable[..., Any]:
    """torch's non-reentrant checkpoint generator, noting each call."""

    def noted(*args: Any, **kwargs: Any) -> Any:
        calls.append("non-reentrant")
        return generator(*args, **kwargs)

    return noted
