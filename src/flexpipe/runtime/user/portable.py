"""Sending a model with parametrizations (``weight_norm``, ``spectral_norm``, ``orthogonal``,
your own) to the rank processes. torch refuses to serialize a parametrized module (its class
is made at run time), so a launch registers, for each parametrized class among its
arguments, a reducer that sends the module as the class it had before and its
parametrizations, and rebuilds it in the rank process as ``register_parametrization`` builds
it (``portable``). Anything else that cannot be sent fails the launch with an error naming the
way round it: a factory every rank calls (``unsendable``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from flexpipe.errors import ConfigError


def portable(obj: object) -> None:
    """Let every parametrized module inside ``obj`` (lists, tuples, dicts and dataclasses
    followed, as a launch's arguments hold them) cross to a spawned process."""
    for module in _modules(obj, set()):
        for sub in module.modules():
            if parametrize.is_parametrized(sub):
                ForkingPickler.register(type(sub), _reduce)


def _modules(obj: object, seen: set[int]) -> Iterator[nn.Module]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        yield obj
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _modules(item, seen)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _modules(item, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _modules(getattr(obj, f.name), seen)


def _reduce(module: nn.Module) -> tuple[Any, tuple[Any, ...]]:
    """A parametrized module as (its class before, its attributes, its parametrized names).
    Hooks that cannot be sent stay behind (``weight_norm``'s, a closure that loads a
    checkpoint of the older ``weight_g``/``weight_v`` form)."""
    names = tuple(module.parametrizations.keys())  # type: ignore[union-attr,operator]
    state = {k: _sendable(v) if k.endswith("hooks") and isinstance(v, dict) else v
             for k, v in module.__dict__.items()}
    return _rebuild, (parametrize.type_before_parametrizations(module), state, names)


def _sendable(hooks: dict[Any, Any]) -> dict[Any, Any]:
    """The hooks of ``hooks`` that can be sent to a process."""
    out = type(hooks)()
    for key, hook in hooks.items():
        try:
            ForkingPickler.dumps(hook)
        except Exception:  # noqa: BLE001 - any failure to serialize leaves the hook behind
            continue
        out[key] = hook
    return out


def _rebuild(kind: type[nn.Module], state: dict[str, Any], names: tuple[str, ...]
             ) -> nn.Module:
    """The parametrized module again: its attributes (the ``parametrizations`` with the
    original tensors among them) on its class before, then the class and properties
    ``register_parametrization`` gives it."""
    module = kind.__new__(kind)
    module.__dict__.update(state)
    parametrize._inject_new_class(module)  # noqa: SLF001 - torch builds them so, nothing public
    for name in names:
        parametrize._inject_property(module, name)  # noqa: SLF001
    return module


def unsendable(exc: BaseException) -> ConfigError:
    """The error of a launch whose arguments could not be sent to the rank processes."""
    return ConfigError(
        f"cannot send the job to the rank processes ({type(exc).__name__}: {exc}); a model "
        "torch cannot serialize (a lambda, a non-leaf tensor kept as an attribute, as the older "
        "nn.utils.weight_norm keeps one) goes to the ranks as a factory every rank calls: "
        "ModelSpec('user', factory='package.module:function') or --model "
        "package.module:function")
