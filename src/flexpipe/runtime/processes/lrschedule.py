"""The learning rate of each step, with torchtitan's ``[lr_scheduler]`` meaning: a linear
warm-up over ``warmup_steps``, then a stable phase at the base rate, then a decay over the last
``decay_ratio`` of the steps (all the steps after the warm-up when it is None) down to
``min_lr_factor`` x the base rate, ``linear``, ``sqrt`` or ``cosine`` (with a stable phase: a
warm-up-stable-decay, WSD, schedule). ``constant`` keeps the base rate after the warm-up.

The factor of step ``k`` (0-based) is torchtitan's ``linear_warmup_stable_decay``: during the
warm-up ``(k + 1) / (warmup_steps + 1)``; in the decay, with ``progress = (k + 1 - warmup -
stable) / decay_steps``, ``min + (1 - min) x f(progress)``. A pure function of the step, so a
resumed run takes the same rates as an uninterrupted one."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from flexpipe.errors import ConfigError

DECAYS: dict[str, Callable[[float], float]] = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "constant": lambda p: 1.0,
}
"""The decay shapes: the factor at ``progress`` p in [0, 1] of the decay phase."""


@dataclass(frozen=True)
class LRSchedule:
    """A warm-up, stable and decay schedule over ``steps`` optimizer steps."""

    steps: int
    warmup_steps: int = 0
    decay_ratio: float | None = None
    decay_type: str = "constant"
    min_lr_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.decay_type not in DECAYS:
            raise ConfigError(f"lr_scheduler decay_type {self.decay_type!r} is not one of "
                              f"{', '.join(DECAYS)}")
        if self.warmup_steps < 0:
            raise ConfigError(f"lr_scheduler warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            raise ConfigError(f"lr_scheduler decay_ratio must be in [0, 1], got "
                              f"{self.decay_ratio}")
        if not 0.0 <= self.min_lr_factor <= 1.0:
            raise ConfigError(f"lr_scheduler min_lr_factor must be in [0, 1], got "
                              f"{self.min_lr_factor}")

    def phases(self) -> tuple[int, int, int]:
        """(warm-up, stable, decay) step counts, as torchtitan sizes them: the warm-up at most
        every step, the decay at most what the warm-up leaves."""
        warmup = min(self.warmup_steps, self.steps)
        decay = self.steps - warmup if self.decay_ratio is None else \
            min(round(self.steps * self.decay_ratio), self.steps - warmup)
        return warmup, self.steps + 1 - warmup - decay, decay

    def factor(self, step: int) -> float:
        """The multiplier of the base learning rate at 0-based ``step``."""
        warmup, stable, decay = self.phases()
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if step < warmup + stable or decay == 0:
            return 1.0
        progress = min(1.0, (step + 1 - warmup - stable) / decay)
        shape = DECAYS[self.decay_type](progress)
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * shape
