"""Schedule specs: the one entry point that turns what a user names -- a library name (or a
torch/torchtitan alias of one), a schedule file (``.txt``/``.sched`` text, ``.csv`` torch
compute-only CSV), a DSL ``.py`` program, or ``torch:NAME`` (one of torch's own schedule
classes) -- into a ``Schedule``.

It sits above the runtime (``torch:NAME`` is read by
``flexpipe.runtime.interop.torch_schedules``, the only torch user), so the schedule library below
it never imports upward.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.registry import build, library, resolve


def _exists(path: Path) -> bool:
    """``path.exists()``, False for names the OS cannot even look up (too long, NUL bytes)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def load(spec: str, p: int | None = None, m: int | None = None, **params: object) -> Schedule:
    """A library name (needs p and m) or a path to a schedule file: ``.txt``/``.sched`` text,
    ``.csv`` torch.distributed.pipelining compute-only CSV, or a ``.py`` DSL program (run for
    at most ``program_timeout_s`` seconds, ``flexpipe.dsl.loader.DEFAULT_TIMEOUT_S`` when
    None); or ``torch:NAME``, one of torch's built-in schedule classes (needs p, m and torch);
    torch's and torchtitan's names (``Interleaved1F1B``, ``ZBVZeroBubble``, ...) are
    aliases."""
    spec = resolve(spec)
    if spec.lower().startswith("torch:"):
        return _load_torch(spec[len("torch:"):], p, m, **params)
    if ".py:" in spec or spec.endswith(".py"):
        from flexpipe.dsl.loader import DEFAULT_TIMEOUT_S, load_program

        limit = params.pop("program_timeout_s", None)
        if limit is not None and not isinstance(limit, int | float):
            raise ConfigError(f"program_timeout_s must be a number of seconds, got {limit!r}")
        return load_program(spec, p, m, timeout_s=DEFAULT_TIMEOUT_S if limit is None
                            else float(limit), **params)
    path = Path(spec)
    if path.suffix and _exists(path):
        return _load_file(path, p, m, **params)
    if path.suffix and not _exists(path) and spec.lower() not in library():
        raise ConfigError(f"schedule file {spec!r} does not exist")
    if p is None or m is None:
        raise ConfigError(f"library schedule {spec!r} needs p and m (-p and -m on the "
                          "command line; m= in flexpipe.pipeline, p from the world size)")
    return build(spec, p, m, **params)


def _load_torch(name: str, p: int | None, m: int | None, **params: object) -> Schedule:
    """torch's built-in schedule ``name``, read by the runtime layer (the only torch user)."""
    from flexpipe.runtime.interop.torch_schedules import torch_schedule

    return torch_schedule(name, p, m, **params)


def _load_file(path: Path, p: int | None, m: int | None, **params: object) -> Schedule:
    from flexpipe.ir.text import parse_schedule
    from flexpipe.ir.torch_csv import from_torch_csv

    loaders: dict[str, Callable[[], Schedule]] = {
        ".txt": lambda: parse_schedule(_read(path)),
        ".sched": lambda: parse_schedule(_read(path)),
        ".csv": lambda: from_torch_csv(_read(path), microbatches=m, name=path.stem),
    }
    if path.suffix not in loaders:
        raise ConfigError(f"{path}: unknown schedule file type {path.suffix!r} "
                          f"(expected {', '.join(sorted(loaders))})")
    return loaders[path.suffix]()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read schedule file ({exc})") from None
