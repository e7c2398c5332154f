"""How a local launch starts its rank processes: forked from a server that has imported torch
and the runtime once, not spawned anew.

A spawned rank imports torch (about 3 s of CPU), torch's compiler stack (about 2 s, which the
optimizer pulls in when it is built) and the runtime before it does any work; on a machine
with fewer cores than ranks those imports queue behind each other, and a program that
launches many times (a test suite, a notebook, a search that profiles) pays them every time.
Python's ``forkserver`` start method imports ``PRELOAD`` once, in a server process started at
the first launch, and forks every rank from it. What a spawned rank gets from the launcher a
forked one is given explicitly (``RankStart``): the launcher's environment at this launch (the
server has the one of the first), its standard output and error as they are now (a test's
capture, a redirect), and the task and its arguments. Python's own preparation still gives the
rank the launcher's ``sys.path``, working folder and main module.

The task travels as bytes pickled here, tensors by value: ``forkserver`` hands file
descriptors over a socket (at most about 250 per process), and torch would send each tensor's
storage as one. Where ``forkserver`` does not exist (Windows), or ``FLEXPIPE_START_METHOD=spawn``
asks for it, ranks are spawned as before. Environment variables that torch reads when it is
imported take, in a forked rank, the values the launcher had at its first launch.
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import sys
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.context import BaseContext
from typing import Any

PRELOAD = ("__main__", "torch", "torch._dynamo", "flexpipe.runtime.processes.launch")
"""Imported once by the fork server: the launcher's main module (as ``spawn`` imports it in
every rank), torch, its compiler stack and the runtime."""
METHODS = ("forkserver", "spawn")
"""The start methods a launch may use (``FLEXPIPE_START_METHOD``), the default first."""
_TORCH_REDUCERS = "torch.multiprocessing.reductions"

UNSENDABLE: tuple[type[BaseException], ...] = (pickle.PicklingError, TypeError, AttributeError,
                                               RuntimeError)
"""What pickling a launch's task, or starting a rank process with it, raises when something in
it cannot be sent (``portable.unsendable`` turns it into the one error)."""


def context() -> BaseContext:
    """The multiprocessing context ranks start in: ``forkserver`` preloading ``PRELOAD``
    where it exists, else (or when ``FLEXPIPE_START_METHOD=spawn``) ``spawn``."""
    from flexpipe.errors import ConfigError

    asked = os.environ.get("FLEXPIPE_START_METHOD", METHODS[0])
    if asked not in METHODS:
        raise ConfigError(f"FLEXPIPE_START_METHOD={asked!r}: choose one of {list(METHODS)}")
    if asked == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class Fd:
    """One of the launcher's file descriptors, duplicated into the rank that unpickles it
    (``fd`` there is the rank's copy)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _received, (reduction.DupFd(self.fd),)


def _received(dup: Any) -> Fd:
    return Fd(dup.detach())


def dumps(obj: object) -> bytes:
    """``obj`` pickled as a launch sends it (the reducers multiprocessing and
    ``user.portable`` register), but tensors by value rather than in shared memory; what
    cannot be sent stops the launch with ``portable.unsendable``'s error."""
    from flexpipe.runtime.user.portable import unsendable

    buf = io.BytesIO()
    pickler = reduction.ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
    table = pickler.dispatch_table  # type: ignore[attr-defined]
    for cls in [c for c, fn in table.items()
                if getattr(fn, "__module__", "") == _TORCH_REDUCERS]:
        del table[cls]
    try:
        pickler.dump(obj)
    except UNSENDABLE as exc:
        raise unsendable(exc) from exc
    return buf.getvalue()


@dataclass(frozen=True)
class RankStart:
    """What a rank needs from the launcher besides Python's own preparation: the launcher's
    environment, its standard output and error, and the pickled task with its arguments."""

    env: dict[str, str]
    stdout: Fd | None
    stderr: Fd | None
    payload: bytes

    @staticmethod
    def here(payload: bytes) -> RankStart:
        """The start of a rank of this launch (its environment and output as they are now)."""
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:  # None: the launcher's descriptor is closed
                stream.flush()
        return RankStart(dict(os.environ), _open(1), _open(2), payload)

    def enter(self) -> Any:
        """In the rank: take the launcher's environment and output (closed where the
        launcher's is), and unpickle the payload."""
        os.environ.clear()
        os.environ.update(self.env)
        for sent, target in ((self.stdout, 1), (self.stderr, 2)):
            if sent is None:
                with contextlib.suppress(OSError):
                    os.close(target)
            elif sent.fd != target:
                os.dup2(sent.fd, target)
                os.close(sent.fd)
        return pickle.loads(self.payload)


def _open(fd: int) -> Fd | None:
    """``fd`` to send, or None where it is closed in the launcher."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return Fd(fd)
