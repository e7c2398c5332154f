"""The schedule library's index: name -> generator, and one entry point that turns a library
name or a schedule file (text, torch CSV, or a DSL ``.py`` program) into a ``Schedule``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule

Generator = Callable[..., Schedule]

ALIASES: dict[str, str] = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "interleaved-1f1b",
    "loopedbfs": "bfs",
    "zbvzerobubble": "zb-v",
    "interleavedzerobubble": "torch:interleaved-zb",
    "dualpipev": "torch:dualpipev",
}
"""torch.distributed.pipelining's and torchtitan's schedule names (``Interleaved1F1B``, also
with torch's class prefix ``ScheduleInterleaved1F1B``; any case) -> the FlexPipe spec that
runs it: a library name, or ``torch:NAME`` where the library has no equivalent."""


@dataclass(frozen=True)
class Entry:
    """A library schedule: its generator ``fn(p, m, **params)`` and the extra parameters it
    takes (v, w, U, ...) with their defaults."""

    name: str
    fn: Generator
    params: tuple[tuple[str, object], ...]
    summary: str


def _entry(name: str, fn: Generator) -> Entry:
    sig = inspect.signature(fn)
    extra = tuple((k, p.default) for k, p in sig.parameters.items() if k not in ("p", "m"))
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    return Entry(name, fn, extra, doc)


def _library() -> dict[str, Entry]:
    from flexpipe.schedules import classic, vshape, wave, zero_bubble, zeropp

    table: dict[str, Generator] = {
        "gpipe": classic.gpipe,
        "1f1b": classic.one_f_one_b,
        "1f1b-recompute": classic.one_f_one_b_recompute,
        "1f1b-offload": classic.one_f_one_b_offload,
        "interleaved-1f1b": classic.interleaved_1f1b,
        "bfs": classic.looped_bfs,
        "zb-h1": zero_bubble.zb_h1,
        "zb-h2": zero_bubble.zb_h2,
        "zb-v": zero_bubble.zb_v,
        "v-min": vshape.v_min,
        "v-half": vshape.v_half,
        "v-zb": vshape.v_zb,
        "hanayo": wave.hanayo,
        "zeropp": zeropp.zeropp,
    }
    return {name: _entry(name, fn) for name, fn in table.items()}


def library() -> dict[str, Entry]:
    """Every library schedule by name."""
    return _library()


def names() -> list[str]:
    """Library schedule names, sorted."""
    return sorted(_library())


def resolve(name: str) -> str:
    """``name`` with a torch/torchtitan alias (see ``ALIASES``) replaced by its FlexPipe spec;
    any other name unchanged."""
    key = name.lower()
    key = key[len("schedule"):] if key.startswith("schedule") else key
    return ALIASES.get(key, name)


def build(name: str, p: int, m: int, **params: object) -> Schedule:
    """Generate library schedule ``name`` (or a torch/torchtitan alias of one) for p ranks and
    m micro-batches; parameters the schedule does not take are ignored when None and rejected
    otherwise."""
    lib = _library()
    key = resolve(name).lower()
    if key not in lib:
        raise ConfigError(f"unknown schedule {name!r}; known: {', '.join(sorted(lib))}")
    entry = lib[key]
    accepted = {k for k, _ in entry.params}
    given = {k: v for k, v in params.items() if v is not None}
    _check_args(name, p, m, given)
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ConfigError(f"schedule {name!r} takes no parameter {', '.join(unknown)}"
                          + (f" (it takes {', '.join(sorted(accepted))})" if accepted else ""))
    return entry.fn(p, m, **given)


def _check_args(name: str, p: object, m: object, given: dict[str, object]) -> None:
    """Positive integer p and m, and a ``CostModel`` for ``cost``, before any generator runs."""
    from flexpipe.cost.model import CostModel

    for what, value in (("p (ranks)", p), ("m (micro-batches)", m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"schedule {name!r}: {what} must be a positive integer, "
                              f"got {value!r}")
    cost = given.get("cost")
    if cost is not None and not isinstance(cost, CostModel):
        raise ConfigError(f"schedule {name!r}: cost must be a cost model, got "
                          f"{type(cost).__name__}")


def _exists(path: Path) -> bool:
    """``path.exists()``, False for names the OS cannot even look up (too long, NUL bytes)."""
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


def load(spec: str, p: int | None = None, m: int | None = None, **params: object) -> Schedule:
    """A library name (needs p and m) or a path to a schedule file: ``.txt``/``.sched`` text,
    ``.csv`` torch.distributed.pipelining compute-only CSV, or a ``.py`` DSL program; or
    ``torch:NAME``, one of torch's built-in schedule classes (needs p, m and torch); torch's and
    torchtitan's names (``Interleaved1F1B``, ``ZBVZeroBubble``, ...) are aliases."""
    spec = resolve(spec)
    if spec.lower().startswith("torch:"):
        return _load_torch(spec[len("torch:"):], p, m, **params)
    if ".py:" in spec or spec.endswith(".py"):
        from flexpipe.dsl.loader import load_program

        return load_program(spec, p, m, **params)
    path = Path(spec)
    if path.suffix and _exists(path):
        return _load_file(path, p, m, **params)
    if path.suffix and not _exists(path) and spec.lower() not in _library():
        raise ConfigError(f"schedule file {spec!r} does not exist")
    if p is None or m is None:
        raise ConfigError(f"library schedule {spec!r} needs -p and -m")
    return build(spec, p, m, **params)


def _load_torch(name: str, p: int | None, m: int | None, **params: object) -> Schedule:
    """torch's built-in schedule ``name``, read by the runtime layer (the only torch user)."""
    from flexpipe.runtime.torch_schedules import torch_schedule

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
