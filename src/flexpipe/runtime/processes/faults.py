"""Fault injection for reliability tests and benchmarks: when this process starts its n-th
forward pass, make it die (SIGKILL), stall, quit with exit code 0 in the middle of the step, or
poison its stage's first parameter with NaN (a numerical blow-up), optionally writing the
moment of the fault to a file first, so the time from the fault to the launcher's verdict can
be measured."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.runtime.execution.executor import Executor, Handler
from flexpipe.runtime.execution.handlers import HANDLERS

Fault = Callable[[Executor, Op, float], None]


def _kill(ex: Executor, op: Op, stall_s: float) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stall(ex: Executor, op: Op, stall_s: float) -> None:
    time.sleep(stall_s)


def _exit0(ex: Executor, op: Op, stall_s: float) -> None:
    os._exit(0)  # quits "successfully" in the middle of a step, as stray user code might


def _nan(ex: Executor, op: Op, stall_s: float) -> None:
    with torch.no_grad():
        next(ex.stages[op.stage].parameters()).view(-1)[0] = float("nan")


FAULTS: dict[str, Fault] = {"kill": _kill, "stall": _stall, "exit0": _exit0, "nan": _nan}


def forward_fault(fault: str, at_forward: int, *, stamp: str | None = None,
                  stall_s: float = 600.0,
                  base: Mapping[str, Handler] | None = None) -> dict[str, Handler]:
    """A handler table (``base``, default the executor's own) whose ``at_forward``-th forward
    pass (counting from 1) first writes ``time.time()`` to ``stamp`` (when given), then applies
    ``fault``: "kill" (SIGKILL), "stall" (sleep ``stall_s`` seconds, then go on), "exit0"
    (``os._exit(0)``) or "nan" (the stage's first parameter gets a NaN, then the forward runs).
    Pass it to the executor (``run_job(..., handlers=...)``); nothing global changes."""
    if fault not in FAULTS:
        raise ConfigError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")
    table = dict(HANDLERS if base is None else base)
    forward, count = table["F"], [0]

    def hooked(ex: Executor, op: Op) -> None:
        count[0] += 1
        if count[0] == at_forward:
            if stamp is not None:
                Path(stamp).write_text(repr(time.time()))
            FAULTS[fault](ex, op, stall_s)
        forward(ex, op)

    return {**table, "F": hooked}
