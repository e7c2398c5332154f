"""The lanes of overlapped pairs (``flexpipe.runtime.execution.overlap.lanes``): the two passes
of every pair of DualPipeV and DualPipe get different expert lanes, so their all-to-alls never
share a group; a pair that cannot (an odd cycle of pairs) is named and runs in turn."""

from __future__ import annotations

import pytest

from flexpipe.ir.op import Op
from flexpipe.runtime.execution.overlap import PairRunner, lanes
from flexpipe.schedules.registry import build


@pytest.mark.parametrize("name,p,m", [("dualpipev", 2, 4), ("dualpipev", 4, 10),
                                      ("dualpipe", 4, 8), ("dualpipe", 6, 6)])
def test_every_pair_of_the_library_gets_two_lanes(name: str, p: int, m: int) -> None:
    sched = build(name, p, m)
    lane, clash = lanes(sched.overlaps)
    assert sched.overlaps and not clash
    for a, b in sched.overlaps:
        assert lane[(a.stage, a.mb)] != lane[(b.stage, b.mb)]
    for r, ops in enumerate(sched.ranks):
        runner = PairRunner(ops, sched.overlaps, concurrent=True)
        mine = [pr for pr in sched.overlaps if pr[0] in ops]
        assert len(runner.together) == len(runner.heads) == len(mine), r


def test_an_odd_cycle_of_pairs_runs_in_turn() -> None:
    """Three forwards pairwise paired with each other's backwards cannot take two lanes."""
    f = [Op("F", s, 0) for s in range(3)]
    b = [Op("BW", s, 0) for s in range(3)]
    pairs = [(f[0], b[1]), (f[1], b[2]), (f[2], b[0])]
    _, clash = lanes(pairs)
    assert len(clash) == 1
    ops = (f[0], b[1], f[1], b[2], f[2], b[0])
    runner = PairRunner(ops, pairs, concurrent=True)
    assert len(runner.heads) == 3 and len(runner.together) == 2
    (head,) = {0, 2, 4} - runner.together
    assert ops[head] == next(iter(clash))[0]
    calls: list[int] = []
    runner.run(head, ops, calls.append)  # the clashing pair: forward first, in turn
    assert calls == [head, head + 1] and runner.concurrent_runs == 0
    other = min(runner.together)
    runner.run(other, ops, calls.append)
    assert sorted(calls[2:]) == [other, other + 1] and runner.concurrent_runs == 1
    runner.close()
