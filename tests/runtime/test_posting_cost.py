"""The compute thread's time per transfer (``runtime.measurement.posting``): on 2 gloo ranks it
recovers a host cost put into every send, it is 0 on one rank and when a rank has nothing to
run, and the profile's cost model carries it in its links (``Comm.post``). The measurement
reads a virtual clock here (each pass and each slowed send advance it by a set amount, the
real transfers run over gloo), so the figure it must recover is exact on any machine."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from flexpipe.ir.placement import Placement
from flexpipe.runtime.measurement import posting, profile
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch_task

EXTRA_MS = 1.0
"""Host time put into every send: one send per pass, so 0.5 ms per send or receive."""

PASS_MS = 2.0
"""Virtual time of one compute pass."""


class VirtualTime:
    """Stands in for the ``time`` module of ``posting``: ``perf_counter`` reads a clock that
    only ``advance`` moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3


def _compute(clock: VirtualTime) -> None:
    a = torch.ones(32, 32)
    for _ in range(4):
        a = (a @ a).clamp_(max=1.0)
    clock.advance(PASS_MS)


def _measure(rank: int, world: int, extra_ms: float, run: bool) -> list[Any]:
    original, clock = posting._Link.send, VirtualTime()

    def slow_send(self: posting._Link) -> None:
        clock.advance(extra_ms)  # the compute thread busy, as a handler keeps it
        original(self)

    posting._Link.send = slow_send  # type: ignore[method-assign]
    posting.time = clock  # type: ignore[assignment]
    passes = [lambda: _compute(clock)] if run or rank else []
    return [posting.post_time(passes, 4096, 60.0, pairs=4)]


def test_a_host_cost_per_send_is_recovered() -> None:
    (plain,), (slowed,) = (launch_task(_measure, (0.0, True), 2)[0],
                           launch_task(_measure, (EXTRA_MS, True), 2)[0])
    assert plain == 0.0
    assert slowed == pytest.approx(EXTRA_MS / 2, abs=1e-9)


def test_nothing_to_run_or_one_rank_gives_no_posting_cost() -> None:
    assert launch_task(_measure, (EXTRA_MS, False), 2) == [[0.0], [0.0]]
    assert launch_task(_measure, (EXTRA_MS, True), 1) == [[0.0]]


def test_the_profile_puts_it_into_the_links() -> None:
    cost = profile.profile(ModelSpec("gpt", layers=2, hidden=32, heads=2, seq=16, vocab=64,
                                     micro_batch=2), Placement.linear(2), reps=1)
    assert math.isfinite(cost.comm.post) and cost.comm.post >= 0.0
