"""Live progress of a training run: each rank reports every finished step (``StepReport``: its
loss, wall time and peak memory) to the launcher as it happens, over the supervision pipe; the
launcher folds the ranks' reports of one step into one ``Step`` (the slowest rank's time, the
loss of the ranks that compute it, the largest peak) as soon as every rank has sent it."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepReport:
    """What one rank sends after each optimizer step."""

    rank: int
    step: int
    loss: float | None
    """The step's loss on a rank that computes it (the last stage), else None."""
    seconds: float
    peak_bytes: int
    """This rank's peak memory so far: allocated GPU memory on CUDA, else the process's peak
    resident set (RSS)."""
    memory_kind: str = "RSS"
    """What ``peak_bytes`` measures: ``GPU allocated`` or ``RSS``."""
    val_loss: float | None = None
    """The validation loss taken after the step, on a rank that computes it."""


@dataclass(frozen=True)
class Step:
    """One step of the whole run: every rank's reports folded together."""

    step: int
    loss: float | None
    seconds: float
    """The slowest rank's step time."""
    peak_bytes: int
    """The largest peak over the ranks."""
    memory_kind: str
    """What ``peak_bytes`` measures: ``GPU allocated`` or ``RSS``."""
    val_loss: float | None = None
    """The validation loss taken after the step (None: none taken)."""


def step_report(rank: int, step: int, loss: float | None, seconds: float,
                device: torch.device, val_loss: float | None = None) -> StepReport:
    """This rank's report of ``step``, with its peak memory so far."""
    kind = "GPU allocated" if device.type == "cuda" else "RSS"
    return StepReport(rank, step, loss, seconds, peak_bytes(device), kind, val_loss)


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process so far: allocated bytes on a CUDA ``device``, else the peak
    resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(usage if sys.platform == "darwin" else usage * 1024)  # bytes on macOS, KiB else


@dataclass
class StepLog:
    """The launcher side: collects ``StepReport`` s from ``world`` ranks and calls ``on_step``
    with each ``Step`` once every rank has reported it; ``steps`` keeps the completed ones (a
    run that fails or is interrupted still has them)."""

    world: int
    on_step: Callable[[Step], None] | None = None
    steps: list[Step] = field(default_factory=list)
    _pending: dict[int, list[StepReport]] = field(default_factory=dict)

    def add(self, rank: int, report: object) -> None:
        """Take one rank's report (anything else is ignored)."""
        if not isinstance(report, StepReport):
            return
        got = self._pending.setdefault(report.step, [])
        got.append(report)
        if len(got) < self.world:
            return
        del self._pending[report.step]
        losses = [r.loss for r in got if r.loss is not None]
        vals = [r.val_loss for r in got if r.val_loss is not None]
        step = Step(report.step, losses[0] if losses else None, max(r.seconds for r in got),
                    max(r.peak_bytes for r in got), report.memory_kind,
                    vals[0] if vals else None)
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
