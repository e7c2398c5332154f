"""Hostile input: feed every entry point that reads user input many seeded random and mutated
inputs, and check that each either succeeds or raises FlexPipe's own error (``FlexPipeError``:
``ParseError``, ``ConfigError``, ``ValidationError``) -- never another exception, never a hang.

Entry points: ``parse_schedule`` (schedule text), ``from_torch_csv`` (torch CSV), ``load_cost``
(JSON and TOML files), ``cost_from_dict``, ``validate`` on random schedules, ``registry.build``
with random names and parameters, ``specs.load`` with random spec strings, and random DSL
programs loaded as ``.py`` schedule files, and the planner's model and cluster files; then
hostile input that is not a mutation of FlexPipe's own output (``fuzz_hostile``: unicode
digits, huge integers, deep nesting, huge ids, hostile names, unwritable paths) through the
command line in-process, and cost files with overflowing numbers.
Prints one table row per entry point: cases, accepted, rejected with a FlexPipe error, other
exceptions (tracebacks), hangs (a case over ``CASE_LIMIT_S``), silent wrong results
(``fuzz_hostile.WrongResult``: exit 0 on a schedule the validator rejects, JSON with
Infinity/NaN, a raw escape character printed, a file overwritten without --force, ...) and the
slowest case; then the peak memory of the whole run (every case runs in this process, so no
case used more) and the first few offending inputs. Exit status 1 if any count is not 0 or the
peak passes 4 GiB. The size guards see ``FLEXPIPE_MEMORY=2GiB`` (``--memory``), set for the run
whatever the caller's environment says, and restored after it.

    .venv/bin/python benchmarks/fuzz.py [--cases 10000] [--seed 0] [--only NAME] [--memory 2GiB]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fuzz_dsl  # noqa: E402
import fuzz_gen as gen  # noqa: E402
import fuzz_hostile as hostile  # noqa: E402

from flexpipe.cli.guards import MEMORY_ENV  # noqa: E402
from flexpipe.errors import FlexPipeError  # noqa: E402

CASE_LIMIT_S = 10.0
"""Default limit of one case: a case over it counts as a hang."""
MEMORY = "2GiB"
"""The memory the size guards are told this machine has (``FLEXPIPE_MEMORY``) during a run."""
MEMORY_LIMIT = 4 * 2**30
MAX_EXAMPLES = 8  # distinct (exception type, place) examples kept per entry point
Generator = Callable[[Random, Path], gen.Case]


def _plain(fn: Callable[[Random], gen.Case]) -> Generator:
    return lambda rnd, _tmp: fn(rnd)


ENTRY_POINTS: dict[str, Generator] = {
    "parse_schedule (text)": _plain(gen.gen_parse_schedule),
    "from_torch_csv": _plain(gen.gen_torch_csv),
    "load_cost (JSON file)": gen.gen_cost_json,
    "load_cost (TOML file)": gen.gen_cost_toml,
    "cost_from_dict": _plain(gen.gen_cost_dict),
    "validate (random schedules)": _plain(gen.gen_validate),
    "registry.build": _plain(gen.gen_build),
    "specs.load (spec strings)": _plain(gen.gen_load_spec),
    "specs.load (DSL programs)": fuzz_dsl.gen_program,
    "plan load_model (JSON/TOML)": gen.gen_plan_model,
    "plan load_cluster (JSON/TOML)": gen.gen_plan_cluster,
    "CLI commands (hostile files, flags)": hostile.gen_cli_schedules,
    "CLI outputs (unwritable, existing)": hostile.gen_cli_outputs,
    "load_cost (huge numbers, nesting)": hostile.gen_cost_numbers,
}


class CaseTimeout(Exception):
    """A case ran longer than ``CASE_LIMIT_S``."""


@dataclass
class Row:
    """The outcome of one entry point."""

    name: str
    cases: int = 0
    accepted: int = 0
    rejected: int = 0
    other: int = 0
    hangs: int = 0
    wrong: int = 0
    max_s: float = 0.0
    examples: dict[str, str] = field(default_factory=dict)


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CaseTimeout`` in the block after ``seconds`` (main thread, Unix only)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def alarm(_sig: int, _frame: object) -> None:
        raise CaseTimeout(f"case took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_case(row: Row, thunk: Callable[[], object], shown: str,
             limit_s: float = CASE_LIMIT_S) -> None:
    """Run one case and count its outcome in ``row`` (over ``limit_s`` seconds: a hang)."""
    t0 = time.perf_counter()
    try:
        with time_limit(limit_s):
            thunk()
        row.accepted += 1
    except FlexPipeError:
        row.rejected += 1
    except KeyboardInterrupt:
        raise
    except (CaseTimeout, hostile.WrongResult) as exc:
        row.hangs += isinstance(exc, CaseTimeout)
        row.wrong += isinstance(exc, hostile.WrongResult)
        _example(row, exc, shown)
    except BaseException as exc:  # noqa: B036 - SystemExit from a loader is a failure too
        row.other += 1
        _example(row, exc, shown)
    row.cases += 1
    row.max_s = max(row.max_s, time.perf_counter() - t0)


def _example(row: Row, exc: BaseException, shown: str) -> None:
    """Keep the input of a failing case (one per exception type and place)."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    key = f"{type(exc).__name__} at {Path(where.filename).name}:{where.lineno}"
    if key not in row.examples and len(row.examples) < MAX_EXAMPLES:
        row.examples[key] = f"{key}: {str(exc)[:160]}\n      input: {shown}"


def fuzz(name: str, cases: int, seed: int, tmp: Path, limit_s: float = CASE_LIMIT_S) -> Row:
    """Run ``cases`` seeded cases of entry point ``name``."""
    rnd = Random(f"{seed}:{name}")
    row = Row(name)
    make = ENTRY_POINTS[name]
    for _ in range(cases):
        thunk, shown = make(rnd, tmp)
        run_case(row, thunk, shown, limit_s)
    return row


@contextmanager
def stated_memory(memory: str) -> Iterator[None]:
    """Tell the size guards the machine has ``memory`` inside the block, then restore the
    caller's ``FLEXPIPE_MEMORY`` (or its absence): the sizes a case may reach are then the
    same on every machine and under every caller."""
    old = os.environ.get(MEMORY_ENV)
    os.environ[MEMORY_ENV] = memory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MEMORY_ENV, None)
        else:
            os.environ[MEMORY_ENV] = old


def run_all(cases: int, seed: int = 0, only: str | None = None, memory: str = MEMORY,
            limit_s: float = CASE_LIMIT_S) -> list[Row]:
    """Every entry point (or those whose name contains ``only``), with the size guards told
    the machine has ``memory`` and a case over ``limit_s`` seconds counted as a hang."""
    chosen = [n for n in ENTRY_POINTS if only is None or only.lower() in n.lower()]
    with tempfile.TemporaryDirectory(prefix="flexpipe-fuzz-") as tmp, \
            warnings.catch_warnings(), stated_memory(memory):
        warnings.simplefilter("ignore")  # e.g. a coroutine returned by an async "schedule"
        return [fuzz(name, cases, seed, Path(tmp), limit_s) for name in chosen]


def table(rows: list[Row]) -> str:
    """The result table as text."""
    head = ("entry point", "cases", "accepted", "rejected (FlexPipe error)", "other exceptions",
            "hangs", "wrong", "max ms/case")
    body = [(r.name, str(r.cases), str(r.accepted), str(r.rejected), str(r.other),
             str(r.hangs), str(r.wrong), f"{1000 * r.max_s:.1f}") for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths, strict=True)))
             for line in (head, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    """Run and print the table; exit 1 when any case raised a non-FlexPipe exception."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000, help="cases per entry point")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", help="run only entry points whose name contains this")
    ap.add_argument("--memory", default=MEMORY, help="memory the size guards are told of")
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = run_all(args.cases, args.seed, args.only, args.memory)
    print(table(rows))
    peak = peak_memory()
    print(f"\n{sum(r.cases for r in rows)} cases in {time.perf_counter() - t0:.1f} s "
          f"(seed {args.seed}); peak memory of the whole run {peak / 2**20:.0f} MiB "
          f"(limit {MEMORY_LIMIT / 2**30:.0f} GiB)")
    for r in rows:
        for example in r.examples.values():
            print(f"  {r.name}: {example}")
    bad = any(r.other or r.hangs or r.wrong for r in rows) or peak > MEMORY_LIMIT
    return 1 if bad else 0


def peak_memory() -> int:
    """Peak resident memory of this process so far, in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


if __name__ == "__main__":
    sys.exit(main())
