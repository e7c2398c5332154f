"""``flexpipe.sim.reduce``: the gradient reduction on each rank's data-parallel link, checked
against hand-computed cases on unit costs and against a brute-force walk over every op."""

from __future__ import annotations

import pytest

from flexpipe.schedules.registry import build
from flexpipe.sim.engine import simulate
from flexpipe.sim.reduce import ready_times, reduce_step


def _trace(name: str, p: int = 2, m: int = 4):  # type: ignore[no-untyped-def]
    return simulate(build(name, p, m))


def test_1f1b_last_rank_hides_its_reduction_in_the_cool_down() -> None:
    trace = _trace("1f1b")
    ready = ready_times(trace)
    end = max(max(e) for e in trace.ends)
    assert ready[0] == end  # the first stage's last backward ends the step
    assert ready[1] < end
    cost = {0: 0.5, 1: end - ready[1]}  # the last stage's reduction fits its idle tail
    got = reduce_step(trace, cost)
    assert got.overlapped == pytest.approx(end + 0.5)
    assert got.after == pytest.approx(end + max(cost.values()))


def test_nothing_to_reduce_changes_nothing() -> None:
    trace = _trace("zb-h1")
    got = reduce_step(trace, {})
    assert got.overlapped == got.after == got.pipeline
    assert got.hidden == 1.0


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "dualpipev"])
def test_overlap_never_slower_and_matches_a_brute_force_walk(name: str) -> None:
    trace = _trace(name)
    stage_rank = trace.schedule.placement.stage_rank
    cost = {s: 0.3 + 0.1 * s for s in range(trace.schedule.num_stages)}
    got = reduce_step(trace, cost)
    assert got.pipeline <= got.overlapped <= got.after
    # brute force: per rank, the reductions in ready order on one serial link
    ready = {}
    for r, ops in enumerate(trace.schedule.ranks):
        for op, end in zip(ops, trace.ends[r], strict=True):
            if op.kind in ("B", "W", "BW"):
                ready[op.stage] = max(ready.get(op.stage, 0.0), end)
    done = []
    for r in range(trace.schedule.num_ranks):
        free = 0.0
        for s in sorted((s for s in ready if stage_rank[s] == r), key=lambda s: ready[s]):
            free = max(free, ready[s]) + cost[s]
        done.append(max(max(trace.ends[r]), free))
    assert got.overlapped == pytest.approx(max(done))
