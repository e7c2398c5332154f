"""Small validators for the file loaders (cost models, planner models and clusters): each
returns the checked value or raises ``ConfigError`` naming the file (``source``) and the key
path (``where``)."""

from __future__ import annotations

import difflib
import json
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexpipe.errors import ConfigError

Check = Callable[[Any, str, str], float]
MAX_NUMBER = 1e18
"""The largest number a file may give (times, sizes, bandwidths): larger ones overflow the
simulator's sums to inf (1e308 gave "makespan inf")."""
MIN_RATE = 1e-12
"""The smallest positive bandwidth or speed (a smaller one divides a time into inf)."""
MAX_DIGITS = 30
"""Integers in files have at most this many digits (Python refuses more than 4300 anyway)."""
MAX_DEPTH = 64
"""Tables and lists nest at most this deep."""


def read_data(text: str, suffix: str, source: str) -> Any:
    """The content of a ``.json`` or ``.toml`` file's ``text``: a ``ConfigError`` naming the
    file on invalid syntax, an integer of more than ``MAX_DIGITS`` digits, or nesting deeper
    than ``MAX_DEPTH``."""
    try:
        if suffix == ".json":
            data = json.loads(text, parse_int=_int, object_pairs_hook=_no_duplicates)
        else:
            data = tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}: line {exc.lineno}, column {exc.colno}: invalid JSON "
                          f"({exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML ({exc})") from None
    except RecursionError:
        raise ConfigError(f"{source}: nested too deeply (at most {MAX_DEPTH} levels)") from None
    except DuplicateKey as exc:
        raise ConfigError(f"{source}: key {exc.key!r} is given twice in one object (JSON "
                          f"would keep only the last value)") from None
    except ValueError as exc:  # an integer too long to convert, or _int's refusal
        raise ConfigError(f"{source}: a number is too large ({str(exc)[:80]})") from None
    _check_depth(data, source)
    return data


class DuplicateKey(ValueError):
    """A JSON object names ``key`` twice (``json`` would silently keep the last value)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: the object as a dict, refusing a key given twice."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _check_depth(data: Any, source: str) -> None:
    """Reject nesting deeper than ``MAX_DEPTH`` and integers longer than ``MAX_DIGITS``
    (TOML's parser reads those itself), without recursion."""
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: nested too deeply (at most {MAX_DEPTH} levels)")
        if isinstance(value, dict):
            stack += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, list):
            stack += [(v, depth + 1) for v in value]
        elif isinstance(value, int) and not isinstance(value, bool) and \
                abs(value) >= 10**MAX_DIGITS:
            raise ConfigError(f"{source}: an integer of more than {MAX_DIGITS} digits")


def show(value: Any) -> str:
    """A short repr for messages (a huge integer is described, not converted)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    try:
        text = repr(value)
    except ValueError:  # e.g. an integer inside a list past Python's 4300-digit limit
        return f"<a {type(value).__name__} too large to print>"
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
            raise unknown(key, keys, source, where)


def unknown(key: object, keys: Sequence[str], source: str, where: str,
            note: str = "") -> ConfigError:
    """An unknown-key error with a did-you-mean suggestion (same spelling in another case
    first, then the closest key), else the known keys and ``note``."""
    name = str(key)
    by_lower = {k.lower(): k for k in keys}
    guess = by_lower.get(name.lower()) or next(
        iter(difflib.get_close_matches(name, list(keys), n=1, cutoff=0.6)), None)
    hint = f"; did you mean {guess!r}?" if guess else f" (known: {', '.join(keys)}){note}"
    path = f"{where}.{name}" if where else name
    return ConfigError(f"{source}: {path}: unknown key{hint}")


def text(value: Any, source: str, where: str) -> str:
    """``value`` if it is a string."""
    if not isinstance(value, str):
        raise ConfigError(f"{_place(source, where)}must be a string, got {show(value)}")
    return value


def number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool), infinities included."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    if not number(value):
        return False
    try:
        return math.isfinite(value) and abs(value) <= MAX_NUMBER
    except OverflowError:
        return False


def _finite(value: Any) -> bool:
    try:
        return number(value) and math.isfinite(value)
    except OverflowError:
        return False


def nonneg(value: Any, source: str, where: str,
           what: str = "a finite non-negative number") -> float:
    """``value`` as a float if it is a finite non-negative number (at most ``MAX_NUMBER``)."""
    if not _number(value) or value < 0:
        big = f" of at most {MAX_NUMBER:g}" if _finite(value) and value > MAX_NUMBER else ""
        raise ConfigError(f"{_place(source, where)}must be {what}{big}, got {show(value)}")
    return float(value)


def bandwidth(value: Any, source: str, where: str) -> float:
    """A positive number of GB/s, or "inf"."""
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, float) and value == math.inf:
        return math.inf
    if not _number(value) or not value >= MIN_RATE:
        raise ConfigError(f"{_place(source, where)}must be a positive number (from "
                          f"{MIN_RATE:g} to {MAX_NUMBER:g}) or \"inf\", got {show(value)}")
    return float(value)


def count(value: Any, source: str, where: str, most: int, least: int = 1) -> int:
    """``value`` if it is an integer in least..most."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise ConfigError(f"{_place(source, where)}must be an integer in {least}..{most}, got "
                          f"{show(value)}")
    return value


def tables(raw: Any, source: str, where: str, noun: str, most: int, unit: str = "") -> list[Any]:
    """``raw`` if it is a non-empty list (of ``noun`` tables) of at most ``most`` entries."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{_place(source, where)}must be a non-empty list of {noun} tables, "
                          f"got {show(raw)}")
    if len(raw) > most:
        raise ConfigError(f"{_place(source, where)}at most {most}{unit}, got {len(raw)}")
    return raw


def matrix(raw: Any, n: int, source: str, where: str, check: Check, *,
           rows: str = "one row per device", diagonal: float | None = None
           ) -> tuple[tuple[float, ...], ...]:
    """One value for every pair, or an n x n list of lists (``rows`` says what a row is, for
    messages); with ``diagonal`` given, diagonal entries are that value and not checked."""
    if not isinstance(raw, list):
        value = check(raw, source, where)
        return tuple(tuple(value for _ in range(n)) for _ in range(n))
    if len(raw) != n or any(not isinstance(row, list) or len(row) != n for row in raw):
        lengths = [len(r) if isinstance(r, list) else "-" for r in raw]
        raise ConfigError(f"{source}: {where}: must be a {n}x{n} matrix ({rows}) or one number, "
                          f"got {len(raw)} rows of lengths {lengths}")
    return tuple(tuple(diagonal if a == b and diagonal is not None
                       else check(v, source, f"{where}[{a}][{b}]")
                       for b, v in enumerate(row)) for a, row in enumerate(raw))
