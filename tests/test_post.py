"""A link's posting cost (``Comm.post``): the compute thread's time per send and per receive.
The simulator's timeline is checked against a brute-force fixed point of the rule (a compute
op starts after the op before it on its rank plus its receives' posts and after its inputs
arrive; it ends after its duration plus its sends' posts), and a schedule and its lowered
form give the same timeline; without a posting cost every timeline is as before; the cost
travels through cost files, the memo key and the exact search's rounding, and a bad one is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.io import cost_from_dict, cost_to_dict, load_cost
from flexpipe.cost.model import Comm, CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.lower import comm_stages, lower, receive_for, send_after
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import cost_key
from flexpipe.search.exact import integer_cost
from flexpipe.sim import simulate
from flexpipe.specs import load

NAMES = ("1f1b", "zb-h1", "zb-v", "v-half", "v-min", "interleaved-1f1b", "bfs", "gpipe")


def _posting(cost: CostModel, post: float) -> CostModel:
    return CostModel(cost.stages, Comm(cost.comm.latency, cost.comm.bandwidth, post),
                     cost.edges)


def _brute(sched: Schedule, cost: CostModel) -> dict[Op, tuple[float, float]]:
    """(start, end) of every op by sweeping the ranks until nothing changes: an op starts at
    the end of the op before it on its rank plus its receives' posts, and not before each
    input's end plus its transfer; it lasts its time plus its sends' posts."""
    index, where = DepIndex(sched, KINDS), comm_stages(sched)
    rank_of, post = sched.placement.stage_rank, cost.comm.post
    times: dict[Op, tuple[float, float]] = {}
    done = [0] * sched.num_ranks
    while any(d < len(ops) for d, ops in zip(done, sched.ranks, strict=True)):
        moved = False
        for r, ops in enumerate(sched.ranks):
            while done[r] < len(ops):
                op = ops[done[r]]
                needs = index.own_needs(op)
                if any(d not in times for d in needs):
                    break
                prev = times[ops[done[r] - 1]][1] if done[r] else 0.0
                start = max([prev + (post if receive_for(op, where) else 0.0)]
                            + [times[d][1] + cost.comm.time(rank_of[d.stage], r, 0.0)
                               for d in needs])
                dur = cost.stage(op.stage).time(op.kind)
                times[op] = (start, start + dur + (post if send_after(op, where) else 0.0))
                done[r] += 1
                moved = True
        assert moved, "the brute force is stuck"
    return times


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(NAMES), st.integers(2, 4), st.integers(1, 3), st.floats(0.01, 1.0),
       st.floats(0.0, 0.5))
def test_the_timeline_is_the_brute_force_fixed_point(name: str, p: int, k: int, post: float,
                                                     latency: float) -> None:
    sched = load(name, p, p * k)
    cost = _posting(CostModel.uniform(sched.num_stages, p, f=1.0, b=1.2, w=0.7, comm=latency),
                    post)
    trace = simulate(sched, cost)
    want = _brute(sched, cost)
    for r, ops in enumerate(sched.ranks):
        for i, op in enumerate(ops):
            got = (trace.starts[r][i], trace.ends[r][i])
            assert got == pytest.approx(want[op], abs=1e-9), (name, p, r, op)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_schedule_and_its_lowered_form_pay_the_same(name: str, p: int) -> None:
    sched = load(name, p, 2 * p)
    cost = _posting(CostModel.uniform(sched.num_stages, p, f=1.0, b=1.2, w=0.7, comm=0.1), 0.3)
    plain, lowered = simulate(sched, cost), simulate(lower(sched), cost)
    low = lower(sched)
    for r, ops in enumerate(low.ranks):
        at = {op: i for i, op in enumerate(sched.ranks[r])}
        for i, op in enumerate(ops):
            if op in at:
                j = at[op]
                assert (lowered.starts[r][i], lowered.ends[r][i]) == pytest.approx(
                    (plain.starts[r][j], plain.ends[r][j])), (name, r, op)


@pytest.mark.parametrize("name", NAMES)
def test_no_posting_cost_leaves_every_timeline_as_it_was(name: str) -> None:
    sched = lower(load(name, 4, 8))
    cost = CostModel.uniform(sched.num_stages, 4, f=1.0, b=1.2, w=0.7, comm=0.1)
    a, b = simulate(sched, cost), simulate(sched, _posting(cost, 0.0))
    assert (a.starts, a.ends) == (b.starts, b.ends)


def test_each_post_adds_to_a_one_stage_rank_in_full() -> None:
    """On 1F1B with free links every rank's compute time grows by its posts: rank 0 sends m
    activations and receives m gradients, so its busy span grows by 2 m posts at least."""
    sched = load("1f1b", 2, 4)
    cost = CostModel.uniform(2, 2, f=1.0, b=1.0, w=1.0)
    base = simulate(sched, cost).metrics().makespan
    posted = simulate(sched, _posting(cost, 0.25)).metrics().makespan
    assert posted >= base + 2 * 4 * 0.25 - 1e-9


def test_the_posting_cost_travels_through_files(tmp_path: Path) -> None:
    cost = _posting(CostModel.uniform(2, 2, f=1.0, b=1.0, w=1.0, comm=0.1), 0.2)
    table = cost_to_dict(cost)
    assert table["comm"]["post"] == 0.2
    assert cost_from_dict(table).comm.post == 0.2
    assert "post" not in cost_to_dict(_posting(cost, 0.0))["comm"]
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(table))
    assert load_cost(path).comm.post == 0.2


@pytest.mark.parametrize("bad", [-0.1, "fast", float("nan"), True])
def test_a_bad_posting_cost_is_refused_by_name(bad: object) -> None:
    table = cost_to_dict(CostModel.uniform(2, 2, f=1.0, b=1.0, w=1.0))
    table["comm"]["post"] = bad
    with pytest.raises(ConfigError, match="comm.post"):
        cost_from_dict(table)
    with pytest.raises(ConfigError, match="post"):
        Comm.uniform(2, post=bad)  # type: ignore[arg-type]


def test_the_memo_key_and_the_rounding_keep_the_posting_cost() -> None:
    cost = CostModel.uniform(2, 2, f=1.0, b=1.0, w=1.0)
    assert cost_key(cost) != cost_key(_posting(cost, 0.1))
    assert integer_cost(_posting(cost, 0.1), 100.0).comm.post == 10.0


def test_the_exact_search_counts_the_posts_in_each_pass() -> None:
    pytest.importorskip("ortools")
    from flexpipe.ir.placement import Placement
    from flexpipe.search.exact import _Model

    cost = _posting(CostModel.uniform(2, 2, f=1.0, b=1.0, w=1.0), 0.5)
    model = _Model(Placement.linear(2), 2, cost, [1e6, 1e6], True, 100.0)
    k = model.k  # integer units per unit of time
    want = {Op("F", 0, 0): 1.5, Op("F", 1, 0): 1.5, Op("B", 1, 0): 1.5, Op("B", 0, 0): 1.5,
            Op("W", 0, 0): 1.0, Op("W", 1, 0): 1.0}
    assert {op: model.dur[op] / k for op in want} == pytest.approx(want)
