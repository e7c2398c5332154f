"""FlexPipe: programmable pipeline-parallel schedules.

Layers (each imports only those before it): ``ir`` (ops, placements, schedules, text), ``dsl`` and
``schedules`` (the language and its library), ``cost`` (cost model), ``sim`` (simulator, validator
metrics), ``search``/``plan``, ``runtime`` (the only torch user), ``cli``/``viz``.
"""

from flexpipe.errors import (
    ConfigError,
    DeadlockError,
    FlexPipeError,
    ParseError,
    ValidationError,
    Violation,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "DeadlockError",
    "FlexPipeError",
    "ParseError",
    "ValidationError",
    "Violation",
    "__version__",
]
