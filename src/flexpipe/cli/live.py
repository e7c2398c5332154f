"""Live output of ``flexpipe run``: one line per logged step (loss, step time, tokens/s, peak
memory) the moment every rank has finished it, flushed, on stdout (stderr with ``--json``);
on a terminal a rich progress bar with the same figures stays at the bottom. ``Live.steps``
keeps every completed step, so a failed or interrupted run still reports them."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flexpipe.viz.units import fmt_bytes, fmt_ms


@dataclass
class Live:
    """Prints steps as they end. ``tokens`` per step (0: not a token model) and ``unit`` name the
    throughput (tokens/s or samples/s); ``every``: print every k-th step (and the last)."""

    total: int
    tokens: int
    unit: str = "tokens"
    every: int = 1
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    steps: list[Any] = field(default_factory=list)
    suffix: Callable[[Any], str] | None = None
    """More figures of a step for the end of its line (``flexpipe.cli.metrics``)."""
    _bar: Progress | None = None
    _task: Any = None

    def __enter__(self) -> Live:
        if self.stream.isatty():
            console = Console(file=self.stream, highlight=False)
            self._bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.description}"), TimeElapsedColumn(),
                                 console=console, transient=True)
            self._task = self._bar.add_task("", total=self.total)
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def step(self, step: Any, shown: bool = True) -> None:
        """Record one ``flexpipe.runtime.processes.progress.Step``; print it when it is a logged
        one (and ``shown``: a torchrun rank without the loss only counts its steps)."""
        self.steps.append(step)
        if not shown:
            return
        text = self.line(step)
        if self.suffix is not None:
            text = f"{text}  {self.suffix(step)}"
        if self._bar is not None:
            self._bar.update(self._task, completed=len(self.steps), description=text)
        if (step.step + 1) % self.every == 0 or step.step + 1 == self.total:
            if self._bar is not None:
                self._bar.console.print(text)
            else:
                print(text, file=self.stream, flush=True)

    def line(self, step: Any) -> str:
        """``step 3/5: loss 5.4211  step 120.4 ms  4,251 tokens/s  peak RSS 412.0 MiB``."""
        loss = f"loss {step.loss:.4f}" if step.loss is not None else "loss -"
        rate = f"{self.tokens / step.seconds:,.0f} {self.unit}/s" if step.seconds > 0 else ""
        return (f"step {step.step + 1}/{self.total}: {loss}  step {fmt_ms(1e3 * step.seconds)}  "
                f"{rate}  peak {step.memory_kind} {fmt_bytes(step.peak_bytes)}")
