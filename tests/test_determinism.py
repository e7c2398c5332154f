"""The planner and the search give the same answer for the same input however fast the machine
runs: their budgets are counts (simulations, candidates), not seconds. Each is run twice, the
second time under a clock on which an hour passes between any two readings (``slow_clock``:
what a loaded machine looks like to a budget in seconds, pushed to the extreme), so a budget
that reads the clock would stop early and answer otherwise. Deterministic: nothing here
depends on how busy the machine is."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from flexpipe.cost import CostModel
from flexpipe.plan import Options, cluster_preset, model_preset, plan
from flexpipe.search import search

CLOCKS = ("perf_counter", "monotonic", "time")
HOUR = 3600.0


@contextmanager
def slow_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Within: every clock of ``time`` advances an hour per reading; yields the count of
    readings (one list item per reading)."""
    read: list[int] = []

    def clock() -> float:
        read.append(1)
        return len(read) * HOUR

    with monkeypatch.context() as patch:
        for name in CLOCKS:
            patch.setattr(time, name, clock)
        yield read


def twice(fn: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, int]:
    """``fn()`` on the real clock, then on ``slow_clock``; and how often the second read it."""
    first = fn()
    with slow_clock(monkeypatch) as read:
        second = fn()
    return first, second, len(read)


def _plan() -> tuple[object, ...]:
    got = plan(model_preset("gpt-1.3b"), cluster_preset("geo", 4),
               Options(polish_sims=30, refine_candidates=12))
    best = got.best
    return (best.makespan, got.schedule_name, best.candidate, best.schedule.to_text(),
            got.simulated, got.optimal)


def _search() -> tuple[object, ...]:
    cost = CostModel.uniform(4, 4, f=18.522, b=18.086, w=9.337, act=1, wact=0.5, comm=0.601)
    got = search(cost, 4, 8, 3, max_candidates=30)
    assert got.best is not None
    return (got.best.to_text(), [(t.label, t.status, t.span) for t in got.trials], got.lower_bound)


def test_plan_is_the_same_however_slow_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    real, slow, read = twice(_plan, monkeypatch)
    assert real == slow
    assert read > 0  # the planner does read the clock (to report), and ignores it


def test_search_is_the_same_however_slow_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    real, slow, read = twice(_search, monkeypatch)
    assert real == slow and read > 0
    assert any(status == "skipped (effort)" for _, status, _ in real[1])


def test_a_budget_in_seconds_would_be_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: the search's optional wall-clock limit (``max_seconds``) does stop
    early on the slow clock, its candidates skipped for time."""
    cost = CostModel.uniform(4, 4, f=18.522, b=18.086, w=9.337, act=1, wact=0.5, comm=0.601)
    real, slow, _ = twice(lambda: search(cost, 4, 8, 3, max_seconds=60.0), monkeypatch)
    assert real.best is not None and slow.best is None
    assert all(t.status == "skipped (time)" for t in slow.trials)
