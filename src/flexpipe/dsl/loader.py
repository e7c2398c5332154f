"""Load a user's schedule program (a ``.py`` file written against the DSL) and run it.

The file defines a function ``schedule(p, m, ...)`` or marks one with ``@flexpipe.dsl.entry``;
``file.py:name`` picks a function by name. Any error while loading or running the program is
reported as ``file:line: what went wrong`` at the user's own line, never as a traceback from
inside FlexPipe. (A schedule program is code by nature; data files -- schedule text, CSV, cost
files -- are parsed, never executed.)

A program runs under a time limit (``timeout_s``, 60 s unless told: ``--program-timeout`` on
the command line, ``program_timeout_s`` of ``flexpipe.specs.load``): past it, it is stopped
with an error naming the line it was at and how to give it more. The limit is a ``SIGALRM``
timer, so it holds in the main thread (elsewhere, or when the caller's own alarm is due
sooner, the program runs under that alarm only) and stops Python code, not one long call into
C. What the program prints goes to stderr, so it never mixes with a command's ``--json``
output on stdout.
"""

from __future__ import annotations

import contextlib
import inspect
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.ir.schedule import Schedule

MARK = "__flexpipe_entry__"
DEFAULT_TIMEOUT_S = 60.0
"""How long a schedule program may run unless told otherwise."""


class _Expired(BaseException):
    """Raised into the program by the timer (a BaseException: ``except Exception`` in the
    program does not swallow it)."""


def entry(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn(p, m, ...)`` as the schedule a file provides."""
    setattr(fn, MARK, True)
    return fn


def load_program(spec: str, p: int | None, m: int | None, *,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, **params: object) -> Schedule:
    """Run the schedule program at ``spec`` (``path.py`` or ``path.py:function``) for at most
    ``timeout_s`` seconds (None: no limit), its stdout sent to stderr."""
    path_text, _, func = spec.partition(".py:")
    path = Path(path_text + ".py" if func else spec)
    source = _read(path)
    with _bounded(path, timeout_s), contextlib.redirect_stdout(sys.stderr):
        return _run(path, source, func, p, m, params)


@contextlib.contextmanager
def _bounded(path: Path, timeout_s: float | None) -> Iterator[None]:
    """Within: user code is stopped after ``timeout_s`` seconds with a ConfigError naming the
    line it was at; a caller's alarm (pytest-timeout's, ...) is put back afterwards."""
    outer = signal.getitimer(signal.ITIMER_REAL)[0] if hasattr(signal, "setitimer") else 0.0
    if timeout_s is None or threading.current_thread() is not threading.main_thread() or \
            not hasattr(signal, "setitimer") or 0 < outer <= timeout_s:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise _Expired

    start, previous = time.monotonic(), signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    except _Expired as exc:
        line = _user_line(path, exc.__traceback__)
        where = f"{path}:{line}" if line else str(path)
        raise ConfigError(f"{where}: the schedule program ran past its time limit of "
                          f"{timeout_s:g}s and was stopped here; give it more with "
                          "--program-timeout SECONDS (program_timeout_s= in "
                          "flexpipe.specs.load)") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def _run(path: Path, source: str, func: str, p: int | None, m: int | None,
         params: dict[str, object]) -> Schedule:
    """Execute the program's file and call its schedule function (``load_program``)."""
    namespace: dict[str, Any] = {"__name__": "flexpipe_user_program", "__file__": str(path)}
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    _guard(path, lambda: exec(code, namespace))  # noqa: S102 - the user's own schedule program
    fn = _pick(path, namespace, func)
    args = {"p": p, "m": m, **{k: v for k, v in params.items() if v is not None}}
    try:
        accepted = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: {getattr(fn, '__name__', fn)!r} is not a function of "
                          "(p, m, ...) that FlexPipe can call") from None
    takes_any = any(x.kind is inspect.Parameter.VAR_KEYWORD for x in accepted.values())
    unknown = [k for k in args if k not in accepted and not takes_any]
    if unknown and any(args[k] is not None for k in unknown):
        raise ConfigError(f"{path}: {fn.__name__}() takes no parameter "
                          f"{', '.join(k for k in unknown if args[k] is not None)}")
    call = {k: v for k, v in args.items() if k in accepted or takes_any}
    result = _guard(path, lambda: fn(**call))
    if not isinstance(result, Schedule) and hasattr(result, "build"):  # a Program
        result = _guard(path, result.build)
    if not isinstance(result, Schedule):
        raise ConfigError(f"{path}: {fn.__name__}() returned {type(result).__name__}, "
                          "expected a Schedule or a Program")
    return result


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read schedule program ({exc})") from None


def _pick(path: Path, namespace: dict[str, Any], func: str) -> Callable[..., Any]:
    if func:
        fn = namespace.get(func)
        if not callable(fn):
            raise ConfigError(f"{path}: no function named {func!r}")
        return fn
    marked = [v for v in namespace.values() if callable(v) and getattr(v, MARK, False)]
    if len(marked) > 1:
        names = ", ".join(v.__name__ for v in marked)
        raise ConfigError(f"{path}: several @entry functions ({names}); pick one with {path}:NAME")
    if marked:
        return marked[0]
    fn = namespace.get("schedule")
    if callable(fn):
        return fn
    raise ConfigError(f"{path}: defines no schedule; write `def schedule(p, m): ...` or mark a "
                      "function with @flexpipe.dsl.entry")


def _guard(path: Path, thunk: Callable[[], Any]) -> Any:
    """Run user code; turn any exception into an error at the user's line."""
    try:
        return thunk()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - user code's failures (and exit())
        # are reported, not raised
        line = _user_line(path, exc.__traceback__)
        where = f"{path}:{line}" if line else str(path)
        what = str(exc) if isinstance(exc, FlexPipeError) else f"{type(exc).__name__}: {exc}"
        raise ConfigError(f"{where}: {what}") from None


def _user_line(path: Path, tb: TracebackType | None) -> int | None:
    """The innermost line of ``path`` in the traceback."""
    line = None
    for frame in traceback.extract_tb(tb):
        if Path(frame.filename) == path:
            line = frame.lineno
    return line
