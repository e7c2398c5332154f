"""Fault injection for reliability tests and benchmarks: make this process die (SIGKILL) or
stall when it starts its n-th forward pass, optionally writing the moment of the fault to a
file first, so the time from the fault to the launcher's verdict can be measured."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.runtime.execution.executor import Executor, Handler
from flexpipe.runtime.execution.handlers import HANDLERS


def _kill(stall_s: float) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stall(stall_s: float) -> None:
    time.sleep(stall_s)


FAULTS: dict[str, Callable[[float], None]] = {"kill": _kill, "stall": _stall}


def forward_fault(fault: str, at_forward: int, *, stamp: str | None = None,
                  stall_s: float = 600.0,
                  base: Mapping[str, Handler] | None = None) -> dict[str, Handler]:
    """A handler table (``base``, default the executor's own) whose ``at_forward``-th forward
    pass (counting from 1) first writes ``time.time()`` to ``stamp`` (when given), then applies
    ``fault``: "kill" (SIGKILL) or "stall" (sleep ``stall_s`` seconds, then go on). Pass it to
    the executor (``run_job(..., handlers=...)``); nothing global changes."""
    if fault not in FAULTS:
        raise ConfigError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
    table = dict(HANDLERS if base is None else base)
    forward, count = table["F"], [0]

    def hooked(ex: Executor, op: Op) -> None:
        count[0] += 1
        if count[0] == at_forward:
            if stamp is not None:
                Path(stamp).write_text(repr(time.time()))
            FAULTS[fault](stall_s)
        forward(ex, op)

    return {**table, "F": hooked}
