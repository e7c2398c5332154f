"""The planner and the search give the same answer for the same input on an idle and on a loaded
machine: their budgets are counts (simulations, candidates), not seconds. Each is run twice, the
second time while sibling processes burn every CPU core."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flexpipe.cost import CostModel
from flexpipe.plan import Options, cluster_preset, model_preset, plan
from flexpipe.search import search

BURN = "import time\nend = time.time() + 120\nwhile time.time() < end:\n    pass\n"


@contextmanager
def cpu_burners() -> Iterator[None]:
    """One busy-looping sibling process per core for the duration (ended by their pids)."""
    procs = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def twice(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn()`` on the machine as it is, then under full CPU load."""
    first = fn()
    with cpu_burners():
        second = fn()
    return first, second


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


def test_plan_is_the_same_on_a_loaded_machine() -> None:
    idle, loaded = twice(_plan)
    assert idle == loaded


def test_search_is_the_same_on_a_loaded_machine() -> None:
    idle, loaded = twice(_search)
    assert idle == loaded
    assert any(status == "skipped (effort)" for _, status, _ in idle[1])
