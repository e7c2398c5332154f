"""The checks every command makes before it works on a schedule, called from one place
(``flexpipe.cli.common.load_schedule``) and from ``search``, ``plan`` and ``run`` for their
own sizes:

- size guards: the memory that building, validating and simulating a schedule would take
  (``BYTES_PER_OP`` per op, measured) against what this machine has available (``MemAvailable``,
  or ``FLEXPIPE_MEMORY=8GiB`` to state it); over half of it is refused before any work, with the
  estimate, unless ``--no-size-guard``;
- the validation gate: an invalid schedule is refused with the validator's message, or shown
  under a banner with ``--no-validate``;
- output paths: checked before the work (the folder exists and is writable, the file is not
  there unless ``--force``), so a result is never computed and then lost; no output may be
  another output or one of the command's inputs (``outputs_apart``, for every command);
- safe text: names from files are printed with control characters escaped (no terminal escape
  sequences) and JSON never holds ``Infinity`` or ``NaN``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexpipe.errors import ConfigError, ValidationError
from flexpipe.ir.schedule import Schedule

BYTES_PER_OP = 2048
"""Memory one op takes while a schedule is built, validated, lowered and simulated: measured
500-930 B on library schedules of 8k-262k ops (peak RSS growth / ops), doubled for the views."""
SHARE = 0.5
"""Share of the available memory a command may plan to use."""
MEMORY_ENV = "FLEXPIPE_MEMORY"
"""Environment variable stating the memory the guards assume (e.g. ``8GiB``)."""
RANK_BYTES = 400 * 2**20
"""Memory of one local rank process before its model (Python, torch, the process group):
measured 280 MiB resident after importing torch and the runtime."""
RANKS_PER_CORE = 4
"""Most rank threads a local launch may put on one CPU core."""
SCALES = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def available_memory() -> int:
    """Bytes this machine can give a command: ``FLEXPIPE_MEMORY`` when set, else the kernel's
    ``MemAvailable``, else the free physical pages."""
    stated = os.environ.get(MEMORY_ENV, "").strip().lower()
    if stated:
        number = stated.rstrip("bikmgt")
        try:
            unit = stated[len(number):].removesuffix("b").removesuffix("i")
            return int(float(number) * SCALES[unit])
        except (ValueError, KeyError):
            raise ConfigError(f"{MEMORY_ENV}={stated!r}: expected a size like 8GiB") from None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def size(nbytes: float) -> str:
    """Bytes in words: ``1.50 GiB``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def check_ops(ops: float, what: str, forced: bool, advice: str = "use smaller -p/-m") -> None:
    """Refuse work of about ``ops`` ops when simulating it would take more than ``SHARE`` of
    the available memory (unless ``forced``); ``what`` says what it is."""
    need, have = ops * BYTES_PER_OP, available_memory()
    if forced or need <= SHARE * have:
        return
    raise ConfigError(f"{what} is about {ops:,.0f} ops: building and simulating it would take "
                      f"about {size(need)}, more than {SHARE:.0%} of the {size(have)} this "
                      f"machine has available; {advice}, or give --no-size-guard to try "
                      f"anyway")


PATH_STEPS_PER_S = 2e6
"""Device-path steps (one link's round trip priced) the planner's mapping heuristic makes per
second: measured 1.2e8 steps in about 60 s at 256 devices on the 2-core machine, rounded up."""
LONGEST_S = 60.0
"""Work estimated to take longer than this is refused before it starts (``--no-size-guard``
goes on)."""


def check_seconds(steps: float, rate: float, what: str, forced: bool, advice: str) -> None:
    """Refuse work of ``steps`` steps at ``rate`` steps per second when it would take more than
    ``LONGEST_S`` (unless ``forced``), saying how long it would take and what to do."""
    seconds = steps / rate
    if forced or seconds <= LONGEST_S:
        return
    raise ConfigError(f"{what} would take about {seconds / 60:,.0f} minutes (about "
                      f"{steps:,.0f} steps at {rate:,.0f} per second); {advice}, or give "
                      f"--no-size-guard to wait for it")


def _int(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else default


def before_load(spec: str, ranks: int | None, microbatches: int | None,
                params: Mapping[str, object], forced: bool) -> None:
    """Guard a schedule before it is read or built: a file by its size (an op takes at least
    4 characters), a library schedule by 3 passes x p x v x m."""
    if os.path.isfile(spec):  # False for a name the OS refuses (too long, NUL, ...)
        nbytes = os.path.getsize(spec)
        check_ops(nbytes / 4, f"{safe(spec)} ({size(nbytes)})", forced, "use a smaller file")
        return
    p, m, v = _int(ranks, 4), _int(microbatches, 8), _int(params.get("v"), 2)
    check_ops(3 * p * v * m, f"{safe(spec)} at p={p}, m={m}", forced)


def after_load(schedule: Schedule, spec: str, forced: bool) -> None:
    """Guard a loaded schedule: its ops, and the stage x micro-batch table the validator and
    the simulator keep (a file may declare huge counts with few ops)."""
    cells = schedule.num_stages * schedule.microbatches
    check_ops(max(len(schedule), 3 * cells),
              f"{safe(spec)} ({schedule.num_ranks} ranks, {schedule.num_stages} stages, "
              f"{schedule.microbatches} micro-batches)", forced,
              "use smaller counts")


def check_ranks(processes: int, forced: bool, threads: int = 1) -> None:
    """Refuse a local launch of more rank processes than this machine holds: their memory
    (``RANK_BYTES`` each) within the available memory, their threads within
    ``RANKS_PER_CORE`` per core (more and the transfers time out waiting for a CPU)."""
    cores = os.cpu_count() or 1
    if not forced and processes * threads > RANKS_PER_CORE * cores:
        raise ConfigError(f"{processes} rank processes x {threads} threads on {cores} CPU "
                          f"cores is more than {RANKS_PER_CORE} per core: the ranks would "
                          f"wait on each other past their timeouts; use fewer ranks, or "
                          f"--no-size-guard to try anyway")
    have = available_memory()
    if forced or processes * RANK_BYTES <= have:
        return
    raise ConfigError(f"{processes} rank processes need about {size(processes * RANK_BYTES)} "
                      f"({size(RANK_BYTES)} each before the model), this machine has "
                      f"{size(have)} available; use fewer ranks, or --no-size-guard to try "
                      f"anyway")


def gate(schedule: Schedule, spec: str, no_validate: bool) -> None:
    """Refuse ``schedule`` when the validator rejects it; with ``no_validate``, print a banner
    on stderr instead and go on."""
    if no_validate:
        print(f"flexpipe: warning: {safe(spec)} was not validated (--no-validate): its figures "
              f"are not those of a valid schedule", file=sys.stderr)
        return
    from flexpipe.sim.validate import check

    try:
        check(schedule)
    except ValidationError as exc:
        raise ConfigError(f"{safe(spec)}: {exc}\n('flexpipe validate' lists every violation; "
                          f"--no-validate shows the schedule anyway)") from None


def check_output(path: str | None, force: bool) -> None:
    """Before the work: ``path`` (None: none asked) must be writable, and must not exist
    unless ``force``."""
    if path is None or path == "-":
        return
    try:
        _check_output(Path(path), force)
    except (OSError, ValueError) as exc:  # a name the OS refuses: too long, a NUL byte
        raise ConfigError(f"cannot write {path!r}: {getattr(exc, 'strerror', None) or exc}") \
            from None


OUTPUTS = {"output": "-o", "cost_out": "--cost-out", "trace_out": "--trace-out"}
"""Options (argparse destination -> option) naming a file a command writes."""
INPUTS = {"schedule": "the schedule", "more": "the schedule", "cost": "--cost",
          "config": "--config", "model": "--model", "cluster": "--cluster"}
"""Options (argparse destination -> what it is) naming files a command reads; a value that is
no file (a library schedule, a built-in model) names none, and ``--model PKG.MOD:FACTORY``
names its module's file."""


def outputs_apart(args: Any) -> None:
    """Before the work, for every command: refuse an output option (``OUTPUTS``) naming the
    same file as another output (the second write would replace the first: ``plan -o X
    --cost-out X`` lost the schedule) or as one of the command's inputs (``INPUTS``: it would
    be overwritten, ``--force`` or not), through symbolic or hard links too."""
    seen: dict[tuple[object, ...], str] = {}
    for dest, option in INPUTS.items():
        for path in _files(dest, getattr(args, dest, None)):
            seen.setdefault(_same(path), option)
    inputs = set(seen.values())
    for dest, option in OUTPUTS.items():
        value = getattr(args, dest, None)
        if not isinstance(value, str) or value in ("", "-"):
            continue
        path, key = value, _same(value)
        if key in seen:
            what = "input" if seen[key] in inputs else "first"
            raise ConfigError(f"{seen[key]} and {option} both name {safe(path)!r}: writing "
                              f"{option} would replace the {what} file; give another path")
        seen[key] = option


def _files(dest: str, value: object) -> list[str]:
    """The existing files an input option's value names (none for a name that is no file)."""
    values = value if isinstance(value, list) else [value]
    paths = [v for v in values if isinstance(v, str) and v]
    if dest == "model":
        paths += [str(Path(*v.partition(":")[0].split(".")).with_suffix(".py")) for v in paths
                  if ":" in v and v.partition(":")[0]]
    return [path for path in paths if _is_file(path)]


def _is_file(path: str) -> bool:
    try:
        return os.path.isfile(path)
    except (OSError, ValueError):
        return False


def _same(path: str) -> tuple[object, ...]:
    """What makes two paths one file: its device and inode when it exists (a hard link is the
    same file), else its resolved path (symbolic links followed)."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except (OSError, ValueError):
        return ("path", os.path.realpath(path))


def _check_output(target: Path, force: bool) -> None:
    path = str(target)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ConfigError(f"output {path!r} is a directory")
    if not folder.is_dir():
        raise ConfigError(f"cannot write {path!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {path!r}: folder {str(folder)!r} is not writable")
    if target.exists() and not force:
        raise ConfigError(f"{path!r} exists; give --force to overwrite it")
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"cannot write {path!r}: the file is not writable")


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path``; a ``ConfigError`` (not a traceback) if that fails."""
    try:
        Path(path).write_text(text, encoding="utf-8")
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"cannot write {path!r}: {getattr(exc, 'strerror', None) or exc}") \
            from None


def safe(text: object) -> str:
    """``text`` with control and format characters (escape sequences, bidi overrides) shown
    as ``\\x1b``-style escapes, so that printing it cannot drive the terminal."""
    return "".join(ch if unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn")
                   else ascii(ch)[1:-1] for ch in str(text))


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON null), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """Strict JSON of ``value`` (indented): non-finite numbers become null, never
    ``Infinity``/``NaN``."""
    return json.dumps(finite(value), indent=2, allow_nan=False)
