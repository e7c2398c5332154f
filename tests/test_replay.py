"""Replaying a step with its ops' own durations (``flexpipe.sim.replay``): a simulated step
replays to itself, another cost model's op times replay to that model's timeline, added waits
land in ``between`` and longer ops in ``op_times``; bad input is refused by rank and op."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError, ValidationError
from flexpipe.ir.lower import lower
from flexpipe.sim import Trace, simulate
from flexpipe.sim.replay import replay, split
from flexpipe.specs import load

NAMES = ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "interleaved-1f1b", "bfs")
TIME = st.floats(min_value=0.1, max_value=3.0)


def _cost(p: int, stages: int, f: float, b: float, w: float, comm: float) -> CostModel:
    return CostModel.uniform(stages, p, f=f, b=b, w=w, comm=comm)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(NAMES), st.integers(2, 4), st.integers(1, 3), TIME, TIME, TIME,
       st.floats(0.0, 1.0), TIME, TIME)
def test_another_models_op_times_replay_to_its_timeline(name: str, p: int, k: int, f: float,
                                                        b: float, w: float, comm: float,
                                                        f2: float, b2: float) -> None:
    """Op times from a cost model with other F and B (same links) replay, under the first
    model, to exactly the second model's simulated step; a step replays to itself."""
    sched = lower(load(name, p, p * k))
    cost = _cost(p, sched.num_stages, f, b, w, comm)
    other = simulate(sched, _cost(p, sched.num_stages, f2, b2, w, comm))
    again = replay(other, cost)
    for got, want in ((again.starts, other.starts), (again.ends, other.ends)):
        assert [t for row in got for t in row] == pytest.approx([t for row in want for t in row])
    mine = simulate(sched, cost)
    assert replay(mine, cost).ends == mine.ends


def _shifted(trace: Trace, rank: int, at: int, delay: float) -> Trace:
    """``trace`` with rank ``rank``'s ops from position ``at`` on starting ``delay`` later."""
    def move(row: tuple[float, ...], r: int) -> tuple[float, ...]:
        return row if r != rank else tuple(t + delay * (i >= at) for i, t in enumerate(row))
    return Trace(trace.schedule, tuple(move(s, r) for r, s in enumerate(trace.starts)),
                 tuple(move(e, r) for r, e in enumerate(trace.ends)), ((), ()),
                 source="measured")


def test_a_wait_is_time_between_and_a_longer_op_is_op_time() -> None:
    """1F1B, p = 2, m = 4, F = B = W = 1: the last rank's last op starting 3 later (a wait)
    puts 3 in ``between`` and none in ``op_times``; that op lasting 3 longer instead puts 3 in
    ``op_times`` and none in ``between``."""
    sched = lower(load("1f1b", 2, 4))
    cost = _cost(2, 2, 1.0, 1.0, 1.0, 0.0)
    pred = simulate(sched, cost)
    last = len(sched.ranks[0]) - 1  # rank 0 ends the step (its last backward)
    waited = split(pred, _shifted(pred, 0, last, 3.0), cost)
    assert (waited.op_times, waited.between) == pytest.approx((0.0, 3.0))
    ends = tuple(tuple(t + 3.0 * (r == 0 and i == last) for i, t in enumerate(row))
                 for r, row in enumerate(pred.ends))
    longer = Trace(sched, pred.starts, ends, ((), ()), source="measured")
    slow = split(pred, longer, cost)
    assert (slow.op_times, slow.between) == pytest.approx((3.0, 0.0))


def test_a_trace_that_is_not_the_schedules_is_refused_by_rank() -> None:
    sched = lower(load("1f1b", 2, 4))
    cost = _cost(2, 2, 1.0, 1.0, 1.0, 0.0)
    pred = simulate(sched, cost)
    short = Trace(sched, (pred.starts[0], pred.starts[1][:-1]), pred.ends, ((), ()))
    with pytest.raises(ConfigError, match="rank 1 of the measured trace has"):
        replay(short, cost)
    with pytest.raises(ConfigError, match="1 ranks of times"):
        replay(Trace(sched, pred.starts[:1], pred.ends[:1], ((), ())), cost)


def test_bad_durations_are_refused_naming_the_op() -> None:
    sched = lower(load("gpipe", 2, 2))
    durations: list[list[float | None]] = [[None] * len(ops) for ops in sched.ranks]
    durations[1][0] = -1.0
    with pytest.raises(ValidationError, match=r"rank 1.*position 0.*not a finite"):
        simulate(sched, durations=durations)
    with pytest.raises(ValidationError, match="1 lists of durations for 2 ranks"):
        simulate(sched, durations=durations[:1])
    durations[1] = [None]
    with pytest.raises(ValidationError, match=r"rank 1.*1 durations for"):
        simulate(sched, durations=durations)
