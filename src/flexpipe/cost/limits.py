"""The one memory-limit type of FlexPipe, for ``run``, ``search``, ``validate`` and the API.

A limit is one value for every rank or one value per rank, in one of three units:

- ``M_B``: multiples of one micro-batch's activation on one stage (``--mem 8``). Under unit
  costs (no cost file, or a cost model whose memory is in M_B) this is the cost model's own
  unit; under a cost model in bytes, M_B is the largest activation one micro-batch leaves on
  one stage (the largest ``act``).
- ``bytes``: a size with a unit (``--mem 6GiB``, ``512MiB``, ``2e9B``); needs a cost model whose
  memory is in bytes (a profiled model, the transformer formulas, ``flexpipe run``).
- ``model``: the cost model's own unit, whatever it is (a bare number or list given to the
  library functions: ``search(cost, p, m, 8.0)``).

``parse`` reads the text form; ``MemLimit.of`` accepts what the library functions take; and
``MemLimit.per_rank`` is the one normaliser to per-rank values in the cost model's unit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Union, cast

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError

Unit = Literal["M_B", "bytes", "model"]

BYTE_UNITS = {"b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
              "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
              "tib": 2**40}
"""Size suffixes (case-insensitive): decimal K/M/G/T(B) and binary KiB/MiB/GiB/TiB."""

BYTES_FROM = 1024.0
"""A cost model whose largest activation is at least this is in bytes; below, in M_B."""

HELP = ("memory limit per rank: a number is in M_B (one micro-batch's activation on one stage; "
        "the unit of unit-cost runs), a size with a unit (6GiB, 512MiB) is in bytes; one value "
        "for every rank or one per rank, comma-separated (8,8,6,6)")
"""The ``--mem`` help text every command shows."""


@dataclass(frozen=True)
class MemLimit:
    """A per-rank memory limit: ``values`` (one for every rank, or one per rank) in ``unit``."""

    values: tuple[float, ...]
    unit: Unit = "model"

    def __post_init__(self) -> None:
        if not self.values:
            raise ConfigError("a memory limit needs at least one value")
        for r, v in enumerate(self.values):
            if isinstance(v, bool) or not isinstance(v, int | float) or math.isnan(v) \
                    or not v > 0 or math.isinf(v):
                where = "" if len(self.values) == 1 else f" for rank {r}"
                raise ConfigError(f"memory limit{where} must be a positive number, got {v!r}")

    @classmethod
    def of(cls, limit: LimitLike) -> MemLimit:
        """A ``MemLimit`` from what the library takes: one, a text (``parse``), or a number
        or a sequence of numbers in the cost model's unit."""
        if isinstance(limit, MemLimit):
            return limit
        if isinstance(limit, str):
            return parse(limit)
        if isinstance(limit, int | float) and not isinstance(limit, bool):
            return cls((float(limit),))
        if isinstance(limit, Sequence) and not isinstance(limit, bytes):
            return cls(tuple(cast(Sequence[float], limit)))
        raise ConfigError(f"a memory limit must be a number, one number per rank or a size "
                          f"such as '6GiB', got {limit!r}")

    def per_rank(self, p: int, cost: CostModel | None = None) -> tuple[float, ...]:
        """The limit of each of ``p`` ranks in ``cost``'s memory unit (None: unit costs)."""
        values = self.values * p if len(self.values) == 1 else self.values
        if len(values) != p:
            raise ConfigError(f"give one memory limit or one per rank ({p}), got "
                              f"{len(self.values)}")
        scale = _scale(self.unit, cost)
        return tuple(v * scale for v in values)

    def __str__(self) -> str:
        suffix = {"M_B": " M_B", "bytes": " B", "model": ""}[self.unit]
        return ",".join(f"{v:g}{suffix}" for v in self.values)


LimitLike = Union[MemLimit, str, float, Sequence[float]]  # noqa: UP007 (a runtime alias)


def parse(text: str) -> MemLimit:
    """``"8"`` (M_B), ``"6GiB"`` (bytes), ``"8,8,6,6"`` (per rank); every value of one limit
    in one unit."""
    parts = [_value(x.strip(), text) for x in str(text).split(",")]
    units = {u for _, u in parts}
    if len(units) != 1:
        raise ConfigError(f"memory limit {text!r} mixes M_B and bytes; give every rank's limit "
                          "in one unit")
    return MemLimit(tuple(v for v, _ in parts), units.pop())


def _value(part: str, text: str) -> tuple[float, Unit]:
    """One value of a limit and its unit."""
    number = part.rstrip("bBiIkKmMgGtT")
    suffix = part[len(number):].strip().lower()
    if suffix and suffix not in BYTE_UNITS:
        raise ConfigError(f"memory limit {text!r}: unknown unit {part[len(number):]!r} "
                          f"(a plain number is M_B; sizes: {', '.join(BYTE_UNITS)})")
    try:
        value = float(number)
    except ValueError:
        raise ConfigError(f"memory limit {text!r}: {part!r} is not a number or a size like "
                          "6GiB") from None
    return (value * BYTE_UNITS[suffix], "bytes") if suffix else (value, "M_B")


def in_bytes(cost: CostModel | None) -> bool:
    """Whether ``cost``'s memory is in bytes (its largest activation is 1024 or more)."""
    return cost is not None and max((st.act for st in cost.stages), default=0.0) >= BYTES_FROM


def _scale(unit: Unit, cost: CostModel | None) -> float:
    """What one unit of the limit is in ``cost``'s memory unit."""
    if unit == "model":
        return 1.0
    if unit == "bytes":
        if not in_bytes(cost):
            raise ConfigError("the memory limit is in bytes but the cost model's memory is in "
                              "M_B (unit costs, or a cost file without byte sizes): give a "
                              "plain number of M_B, or a cost model in bytes")
        return 1.0
    if cost is None or not in_bytes(cost):
        return 1.0
    return max(st.act for st in cost.stages)
