"""One agreed order per rank pair: after lowering, on every channel the sender's sends and the
receiver's receives list the same messages in the same order (in-order matching, no tags) and
posting them cannot deadlock -- for every library schedule, the DSL examples, list-scheduled
random stage graphs; a schedule that breaks it is refused naming both ranks and the first
message out of order, by the validator and by the executor before its first step."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.dsl.loader import load_program
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import PairOrderError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.lower import insert_comm, lower
from flexpipe.ir.op import BW, F, Op
from flexpipe.ir.pairs import Message, mismatches, transfers
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules import registry
from flexpipe.sim import simulate
from flexpipe.sim.pairs import pair_violations
from flexpipe.sim.validate import check, validate

EXAMPLES = Path(__file__).parent.parent / "examples"


def _build(name: str, p: int, m: int) -> Schedule:
    params = dict(registry.library()[name].params)
    return registry.build(name, p, m, **({"v": 2} if "v" in params else {}))


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("name", registry.names())
def test_library_schedules_agree_after_lowering(name: str, p: int) -> None:
    schedule = _build(name, p, 2 * p)
    lowered = lower(schedule)
    assert pair_violations(lowered) == []
    t = transfers(lowered)
    assert all(t.sent[ch] == t.received[ch] for ch in t.channels())
    crossing = sum(schedule.placement.stage_rank[a] != schedule.placement.stage_rank[b]
                   for a, b in schedule.graph.edges)
    assert sum(map(len, t.sent.values())) == 2 * crossing * schedule.microbatches


def test_interleaved_and_v_shapes_need_the_agreement() -> None:
    """Without it, receives right before their op disagree with the senders' order (V shapes,
    waves): the check bites on real schedules, and lowering fixes every one."""
    for name in ("zb-v", "v-half", "hanayo"):
        naive = insert_comm(_build(name, 4, 8))
        assert mismatches(transfers(naive)), name
        assert mismatches(transfers(lower(_build(name, 4, 8)))) == [], name


def test_lowering_moves_only_communication() -> None:
    for name in ("zb-v", "interleaved-1f1b", "zeropp"):
        schedule = _build(name, 4, 8)
        lowered = lower(schedule)
        compute = [[op for op in ops if not op.kind.startswith(("SEND_", "RECV_"))]
                   for ops in lowered.ranks]
        assert compute == [list(ops) for ops in schedule.ranks]
        assert simulate(lowered).metrics().makespan == pytest.approx(
            simulate(schedule).metrics().makespan)


def _broken() -> Schedule:
    """1F1B on 2 ranks, lowered, with rank 1 posting micro-batch 1's receive before 0's."""
    lowered = lower(_build("1f1b", 2, 4))
    r1 = list(lowered.ranks[1])
    first = r1.index(Op("RECV_F", 1, 1))
    r1.insert(0, r1.pop(first))
    return lowered.with_ranks([lowered.ranks[0], r1])


def test_a_reordered_pair_is_refused_by_name() -> None:
    broken = _broken()
    with pytest.raises(PairOrderError) as err:
        check(broken)
    (v,) = err.value.violations
    assert v.rule == "pair-order" and (v.rank, v.position, v.op) == (1, 0, "1RECV_F1")
    assert "ranks 0 -> 1 disagree at message 0: rank 0 sends F0 0>1 there, rank 1 receives " \
           "F1 0>1" in v.reason


def test_the_executor_refuses_it_before_the_first_step() -> None:
    torch = pytest.importorskip("torch")
    from flexpipe.runtime.execution.executor import Executor
    from flexpipe.runtime.execution.handlers import HANDLERS
    from flexpipe.runtime.transport.p2p import P2P

    with pytest.raises(PairOrderError, match="ranks 0 -> 1 disagree at message 0"):
        Executor(_broken(), 1, {}, lambda *a: a[0], P2P([0, 1], 5.0, torch.device("cpu")),
                 HANDLERS)


def test_launch_refuses_it_before_spawning_a_process() -> None:
    pytest.importorskip("torch")
    from flexpipe.runtime.processes.launch import launch
    from flexpipe.runtime.processes.train import Job

    with pytest.raises(PairOrderError, match=r"\[pair-order\] rank 1, position 0, op 1RECV_F1"):
        launch([Job(_broken())], 2)


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


def test_a_join_from_one_rank_gets_its_messages_back_to_back() -> None:
    """Stages 0 and 1 on rank 0 both feed stage 2 on rank 1: one receive op takes both
    messages, so no other message of the channel goes between them."""
    graph = StageGraph(3, ((0, 2), (1, 2)))
    placement = Placement((0, 0, 1), 2)
    schedule = policy_schedule(placement, 4, Policy(prefer=("B", "F"), split=False),
                               graph=graph)
    lowered = lower(schedule)
    assert pair_violations(lowered) == []
    sent = transfers(lowered).sent[(0, 1)]
    for mb in range(4):
        at = sorted(sent.index(Message("F", s, 2, mb)) for s in (0, 1))
        assert at[1] == at[0] + 1


@pytest.mark.parametrize("spec,p", [("my_1f1b_early_w.py", 4), ("two_tower.py", 3),
                                    ("two_tower.py", 4)])
def test_dsl_examples_agree(spec: str, p: int) -> None:
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
def test_random_graphs_lower_to_an_agreed_order_or_are_refused_by_name(
        case: tuple[StageGraph, Placement, int, bool]) -> None:
    """List-scheduled random stage graphs: the lowering is valid and keeps the timing; every
    channel agrees, or (some graphs with a fork or a join across a rank pair) the validator
    refuses it by name, never a silently mismatched transfer. Chains, towers,
    encoder-decoders and gangs always agree (above)."""
    graph, placement, m, split = case
    policy = Policy(prefer=("B", "F", "W") if split else ("B", "F"), split=split)
    schedule = policy_schedule(placement, m, policy, graph=graph)
    lowered = lower(schedule)
    assert simulate(lowered).metrics().makespan == pytest.approx(
        simulate(schedule).metrics().makespan)
    found = validate(lowered)
    assert all(v.rule == "pair-order" for v in found), [str(v) for v in found]
    if found:
        assert any(rank < placement.num_ranks for v in found for rank in (v.rank or 0,))
        assert all("disagree" in v.reason or "deadlock in the transport" in v.reason
                   for v in found)
        assert not _simple(graph, placement)


def _simple(graph: StageGraph, placement: Placement) -> bool:
    """Whether every rank pair's edges are a matching (each stage talks to at most one stage of
    the other rank): receives moved earlier suffice there. A fork or a join across a rank pair
    (one op posts several messages of one channel; a fork forward is a join backward) may need
    sends pushed later, which can make ranks wait on each other or leave no agreed order; the
    validator then names the channel or the deadlock."""
    rank = placement.stage_rank
    pairs: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for a, b in graph.edges:
        if rank[a] != rank[b]:
            pairs.setdefault((rank[a], rank[b]), []).append((a, b))
    for edges in pairs.values():
        srcs = [a for a, _ in edges]
        dsts = [b for _, b in edges]
        if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
            return False
    return True
