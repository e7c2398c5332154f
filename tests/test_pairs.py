"""The transport rule: messages are matched in order with no tags, and the receiver posts each
channel's receives in the SENDER's order, so any receive order is matched right -- skip edges
under interleaved and V placements included -- while posting them cannot deadlock, for every
library schedule, the DSL examples and list-scheduled random stage graphs; a message only one
side posts, or a transport that would deadlock, is refused by name by the validator, the
executor and the launcher."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.dsl.loader import load_program
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import PairOrderError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.lower import lower
from flexpipe.ir.op import BW, F, Op
from flexpipe.ir.pairs import mismatches, transfers
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules import registry
from flexpipe.sim import simulate
from flexpipe.sim.pairs import pair_violations
from flexpipe.sim.validate import check, validate

EXAMPLES = Path(__file__).parent.parent / "examples"


def _build(name: str, p: int, m: int) -> Schedule:
    """Library schedule ``name`` (v = 2 where it takes chunks); skipped where the family is not
    defined (DualPipe at an odd p)."""
    entry = registry.library()[name]
    if not entry.builds(p, m):
        pytest.skip(f"{name} is not defined at p = {p}, m = {m}")
    params = dict(entry.params)
    return registry.build(name, p, m, **({"v": 2} if "v" in params else {}))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name", registry.names())
def test_library_schedules_transport_cleanly(name: str, p: int) -> None:
    schedule = _build(name, p, 2 * p)
    lowered = lower(schedule)
    assert pair_violations(lowered) == []
    t = transfers(lowered)
    assert sorted(map(sorted, t.sent.values())) == sorted(map(sorted, t.received.values()))
    crossing = sum(schedule.placement.stage_rank[a] != schedule.placement.stage_rank[b]
                   for a, b in schedule.graph.edges)
    assert sum(map(len, t.sent.values())) == 2 * crossing * schedule.microbatches


def test_receives_in_another_order_than_sent_are_matched() -> None:
    """V shapes and waves receive in another order than their senders send: nothing is
    reordered for it (the receiver posts in the sender's order)."""
    for name in ("zb-v", "v-half", "hanayo"):
        lowered = lower(_build(name, 4, 8))
        t = transfers(lowered)
        assert any(t.sent[ch] != t.received[ch] for ch in t.channels()), name
        assert mismatches(t) == [] and pair_violations(lowered) == [], name


SKIPS = [("interleaved-1f1b", ((0, 1), (1, 2), (2, 3), (0, 3))),
         ("interleaved-1f1b", ((0, 1), (1, 2), (2, 3), (0, 2), (1, 3))),
         ("v-half", ((0, 1), (1, 2), (2, 3), (0, 3)))]


@pytest.mark.parametrize(("name", "edges"), SKIPS)
def test_skip_edges_two_stages_on_are_valid(name: str, edges: tuple[tuple[int, int], ...]
                                             ) -> None:
    """A mask or a residual read two or more stages later (BERT's attention mask, a CNN's
    long residual) under interleaved and V placements: its message crosses its neighbours',
    which the sender-order receive handles."""
    schedule = replace(registry.build(name, 2, 4), graph=StageGraph(4, edges))
    assert validate(schedule) == []


def _reordered() -> Schedule:
    """1F1B on 2 ranks, lowered, with rank 1 posting micro-batch 1's receive before 0's."""
    lowered = lower(_build("1f1b", 2, 4))
    r1 = list(lowered.ranks[1])
    first = r1.index(Op("RECV_F", 1, 1))
    r1.insert(0, r1.pop(first))
    return lowered.with_ranks([lowered.ranks[0], r1])


def test_a_reordered_pair_is_valid() -> None:
    t = transfers(_reordered())
    assert t.sent[(0, 1)][:2] != t.received[(0, 1)][:2]
    check(_reordered())


def test_the_executor_and_launch_refuse_a_one_sided_message() -> None:
    pytest.importorskip("torch")
    from flexpipe.runtime.processes.launch import launch
    from flexpipe.runtime.processes.train import Job

    lowered = lower(_build("1f1b", 2, 2))
    r0 = [op for op in lowered.ranks[0] if op != Op("SEND_F", 0, 1)]
    with pytest.raises(PairOrderError, match="which never sends it"):
        launch([Job(lowered.with_ranks([r0, lowered.ranks[1]]))], 2)


def test_a_send_posted_after_what_waits_for_it_deadlocks_the_transport() -> None:
    """The simulator times messages from the producer's end; the transport sends at the send
    op. Rank 0 sending its activation only after its backward waits forever."""
    r0 = [F(0, 0), Op("RECV_B", 0, 0), BW(0, 0), Op("SEND_F", 0, 0)]
    r1 = [Op("RECV_F", 1, 0), F(1, 0), BW(1, 0), Op("SEND_B", 1, 0)]
    schedule = Schedule.build([r0, r1], Placement.linear(2), 1)
    found = validate(schedule)
    assert [v.rule for v in found] == ["pair-order", "pair-order"]
    assert "rank 0 waits at 0BW0 for message B0 1>0 from rank 1" in found[0].reason
    assert "rank 1 waits at 1F0 for message F0 0>1 from rank 0" in found[1].reason


def test_a_message_only_one_side_posts_is_named() -> None:
    lowered = lower(_build("1f1b", 2, 2))
    r0 = [op for op in lowered.ranks[0] if op != Op("SEND_F", 0, 1)]
    found = pair_violations(lowered.with_ranks([r0, lowered.ranks[1]]))
    assert [v.reason for v in found] == [
        "rank 1 receives F1 0>1 from rank 0, which never sends it"]


@pytest.mark.parametrize("spec,p", [("my_1f1b_early_w.py", 4), ("two_tower.py", 3),
                                    ("two_tower.py", 4)])
def test_dsl_examples_transport_cleanly(spec: str, p: int) -> None:
    schedule = load_program(str(EXAMPLES / spec), p, 8)
    assert pair_violations(lower(schedule)) == []


@st.composite
def graph_cases(draw: st.DrawFn) -> tuple[StageGraph, Placement, int, bool]:
    """A random stage DAG (every stage reaches the last one), a random placement, m, split."""
    n = draw(st.integers(2, 6))
    edges = set()
    for t in range(1, n):
        preds = draw(st.sets(st.integers(0, t - 1), min_size=0, max_size=2))
        edges |= {(s, t) for s in preds}
    for s in range(n - 1):  # every stage feeds a later one
        if not any(a == s for a, _ in edges):
            edges.add((s, draw(st.integers(s + 1, n - 1))))
    p = draw(st.integers(2, 3))
    ranks = tuple(draw(st.integers(0, p - 1)) for _ in range(n))
    return (StageGraph(n, tuple(sorted(edges))), Placement(ranks, p), draw(st.integers(1, 4)),
            draw(st.booleans()))


@settings(max_examples=60, deadline=None)
@given(graph_cases())
def test_random_graphs_lower_to_a_valid_transport(
        case: tuple[StageGraph, Placement, int, bool]) -> None:
    """List-scheduled random stage graphs (forks and joins across a rank pair included): the
    lowering keeps the timing and its transport is valid -- sends right after their data,
    receives posted in the senders' order -- never a mismatched transfer or a deadlock."""
    graph, placement, m, split = case
    policy = Policy(prefer=("B", "F", "W") if split else ("B", "F"), split=split)
    schedule = policy_schedule(placement, m, policy, graph=graph)
    lowered = lower(schedule)
    assert simulate(lowered).metrics().makespan == pytest.approx(
        simulate(schedule).metrics().makespan)
    assert validate(lowered) == [], [str(v) for v in validate(lowered)]
