"""Op timestamps of one step. On the CPU: host time. On a GPU: CUDA events on the current
(compute) stream, read once when the step ends, so an op's start and end are when the GPU
began and finished its work (the host only queues it), with no synchronisation between ops;
the measured trace then compares with the simulator's on a GPU as on the CPU."""

from __future__ import annotations

import time

import torch

Stamp = float | torch.cuda.Event
"""Seconds since the step started (CPU), or an event to be read at the step's end (GPU)."""


class StepClock:
    """The executor's clock for the ops of one step on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.t0 = time.perf_counter()
        self.origin: torch.cuda.Event | None = None

    def start(self) -> None:
        """The step starts now."""
        self.t0 = time.perf_counter()
        if self.cuda:
            self.origin = self._event()

    def stamp(self) -> Stamp:
        """A timestamp now (on a GPU: when the GPU gets here)."""
        if self.cuda:
            return self._event()
        return time.perf_counter() - self.t0

    def seconds(self, stamps: list[Stamp]) -> list[float]:
        """``stamps`` as seconds since the step started (on a GPU: after it has finished)."""
        if self.cuda and any(isinstance(s, torch.cuda.Event) for s in stamps):
            torch.cuda.synchronize(self.device)
        return [self._read(s) for s in stamps]

    def _read(self, stamp: Stamp) -> float:
        if isinstance(stamp, torch.cuda.Event):
            assert self.origin is not None, "a GPU stamp before the step started"
            return self.origin.elapsed_time(stamp) / 1e3
        return stamp

    @staticmethod
    def _event() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
