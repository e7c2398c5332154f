"""Small validators for the planner's file loaders: each returns the checked value or raises
``ConfigError`` naming the file (``source``) and the key path (``where``)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexpipe.errors import ConfigError

Check = Callable[[Any, str, str], float]


def show(value: Any) -> str:
    """A short repr for messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _place(source: str, where: str) -> str:
    return f"{source}: {where}: " if where else f"{source}: "


def table(value: Any, source: str, where: str) -> Mapping[str, Any]:
    """``value`` if it is a table."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{_place(source, where)}must be a table (object), got {show(value)}")
    return value


def known(tab: Mapping[str, Any], keys: Sequence[str], source: str, where: str) -> None:
    """Reject keys not in ``keys``, with a did-you-mean."""
    for key in tab:
        if key not in keys:
            guess = difflib.get_close_matches(str(key), list(keys), n=1, cutoff=0.6)
            hint = f"; did you mean {guess[0]!r}?" if guess else f" (known: {', '.join(keys)})"
            path = f"{where}.{key}" if where else str(key)
            raise ConfigError(f"{source}: {path}: unknown key{hint}")


def text(value: Any, source: str, where: str) -> str:
    """``value`` if it is a string."""
    if not isinstance(value, str):
        raise ConfigError(f"{_place(source, where)}must be a string, got {show(value)}")
    return value


def _number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def nonneg(value: Any, source: str, where: str) -> float:
    """``value`` as a float if it is a finite non-negative number."""
    if not _number(value) or value < 0:
        raise ConfigError(f"{_place(source, where)}must be a finite non-negative number, got "
                          f"{show(value)}")
    return float(value)


def bandwidth(value: Any, source: str, where: str) -> float:
    """A positive number of GB/s, or "inf"."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, float) and value == math.inf:
        return math.inf
    if not _number(value) or not value > 0:
        raise ConfigError(f"{_place(source, where)}must be a positive number or \"inf\", got "
                          f"{show(value)}")
    return float(value)


def count(value: Any, source: str, where: str, most: int, least: int = 1) -> int:
    """``value`` if it is an integer in least..most."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{_place(source, where)}must be an integer in {least}..{most}, got "
                          f"{show(value)}")
    return value


def matrix(raw: Any, n: int, source: str, where: str,
           check: Check) -> tuple[tuple[float, ...], ...]:
    """One value for every pair, or an n x n list of lists; diagonal entries are not checked."""
    if not isinstance(raw, list):
        value = check(raw, source, where)
        return tuple(tuple(value for _ in range(n)) for _ in range(n))
    if len(raw) != n or any(not isinstance(row, list) or len(row) != n for row in raw):
        raise ConfigError(f"{source}: {where}: must be one number or a {n}x{n} matrix (one row "
                          f"per device), got {len(raw)} rows")
    return tuple(tuple(0.0 if a == b else check(v, source, f"{where}[{a}][{b}]")
                       for b, v in enumerate(row)) for a, row in enumerate(raw))
