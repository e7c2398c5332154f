"""FlexPipe: programmable pipeline-parallel schedules.

Layers (each imports only those before it): ``ir`` (ops, placements, schedules, text), ``dsl`` and
``schedules`` (the language and its library), ``cost`` (cost model), ``sim`` (simulator, validator
metrics), ``search``/``plan``, ``runtime`` (the only torch user), ``cli``/``viz``.

Your own model: ``flexpipe.pipeline``, ``flexpipe.Pipeline``, ``flexpipe.UserModel``,
``flexpipe.Recompute`` and ``flexpipe.spawn`` (docs/runtime.md) are loaded on first use, so
``import flexpipe`` does not import torch.
"""

from typing import Any

from flexpipe.errors import (
    ConfigError,
    DeadlockError,
    FlexPipeError,
    InfeasibleError,
    ParseError,
    RunError,
    ValidationError,
    Violation,
)

__version__ = "0.1.0"

_LAZY = {"pipeline": "flexpipe.api", "Pipeline": "flexpipe.runtime.pipeline.api",
         "spawn": "flexpipe.runtime.pipeline.api", "UserModel": "flexpipe.runtime.user.model",
         "Recompute": "flexpipe.runtime.user.recompute"}


def __getattr__(name: str) -> Any:
    """The public pipeline API, imported (with torch) on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flexpipe' has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "DeadlockError",
    "FlexPipeError",
    "InfeasibleError",
    "ParseError",
    "RunError",
    "Pipeline",
    "Recompute",
    "UserModel",
    "ValidationError",
    "Violation",
    "__version__",
    "pipeline",
    "spawn",
]
