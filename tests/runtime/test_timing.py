"""The executor's step clock on the CPU: host seconds since the step started, in order."""

from __future__ import annotations

import time

import torch

from flexpipe.runtime.execution.timing import StepClock


def test_cpu_stamps_are_seconds_since_the_step_started() -> None:
    clock = StepClock(torch.device("cpu"))
    clock.start()
    first = clock.stamp()
    time.sleep(0.02)
    second = clock.stamp()
    a, b = clock.seconds([first, second])
    assert 0.0 <= a < b
    assert 0.015 <= b - a < 1.0


def test_a_new_step_restarts_the_clock() -> None:
    clock = StepClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.02)
    clock.start()
    (now,) = clock.seconds([clock.stamp()])
    assert now < 0.015
