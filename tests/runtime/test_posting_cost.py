"""The compute thread's time per transfer (``runtime.measurement.post_cost``): on 2 gloo ranks it
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
from flexpipe.runtime.measurement import post_cost, profile
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch_task

EXTRA_MS = 1.0
"""Host time put into every send: one send per pass, so 0.5 ms per send or receive."""

PASS_MS = 2.0
"""Virtual time of one compute pass."""


class VirtualTime:
    """Stands in for the ``time`` module of ``post_cost``: ``perf_counter`` reads a clock that
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
    """The posting cost measured with ``extra_ms`` put into every send (after the plain one,
    with no extra, when ``extra_ms`` is not 0: both in one launch)."""
    original = post_cost._Link.send
    got = []
    for extra in dict.fromkeys((0.0, extra_ms)) if run else (extra_ms,):
        clock = VirtualTime()

        def slow_send(self: post_cost._Link, clock: VirtualTime = clock,
                      extra: float = extra) -> None:
            clock.advance(extra)  # the compute thread busy, as a handler keeps it
            original(self)

        post_cost._Link.send = slow_send  # type: ignore[method-assign]
        post_cost.time = clock  # type: ignore[assignment]
        passes = [lambda clock=clock: _compute(clock)] if run or rank else []
        got.append(post_cost.post_time(passes, 4096, 60.0, pairs=4))
    return got


def test_a_host_cost_per_send_is_recovered() -> None:
    plain, slowed = launch_task(_measure, (EXTRA_MS, True), 2)[0]
    assert plain == 0.0
    assert slowed == pytest.approx(EXTRA_MS / 2, abs=1e-9)


def test_nothing_to_run_or_one_rank_gives_no_posting_cost() -> None:
    assert launch_task(_measure, (EXTRA_MS, False), 2) == [[0.0], [0.0]]
    assert launch_task(_measure, (EXTRA_MS, True), 1) == [[0.0, 0.0]]  # plain, slowed


def test_the_profile_puts_it_into_the_links() -> None:
    cost = profile.profile(ModelSpec("gpt", layers=2, hidden=32, heads=2, seq=16, vocab=64,
                                     micro_batch=2), Placement.linear(2), reps=1)
    assert math.isfinite(cost.comm.post) and cost.comm.post >= 0.0
