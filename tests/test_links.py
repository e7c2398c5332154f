"""Link contention in the simulator: transfers on one directed link serialize (occupancy
bytes / bandwidth, then latency in flight), a->b and b->a are independent, an output goes once to
each consuming rank; timings worked out by hand and checked against a brute-force reference."""

from __future__ import annotations

import math
import random

import pytest

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.ir import Op, Placement, Schedule, StageGraph
from flexpipe.schedules.registry import build
from flexpipe.sim import simulate

INF = math.inf


def two_ranks(bytes_: float, bandwidth: float, latency: float = 0.0) -> CostModel:
    """Two stages, F = B = W = 1 (BW = 2), one link each way."""
    stage = StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, out_bytes=bytes_)
    lat = ((0.0, latency), (latency, 0.0))
    return CostModel((stage, stage), Comm(lat, ((INF, bandwidth), (bandwidth, INF))))


def test_second_transfer_on_a_link_waits_for_the_first() -> None:
    """GPipe, p = 2, m = 2, bytes / bw = 5: F0 leaves rank 0 at 1 and holds the link until 6,
    F1 (ready at 2) holds it 6..11, so rank 1 starts F1 5 after F0; the gradients do the same
    on the link back (14..19, 19..24)."""
    trace = simulate(build("gpipe", 2, 2), two_ranks(5.0, 1.0))
    assert trace.starts == ((0.0, 1.0, 19.0, 24.0), (6.0, 11.0, 12.0, 14.0))
    assert trace.metrics().makespan == 26.0


def test_infinite_bandwidth_keeps_the_pure_delay() -> None:
    """Infinite bandwidth: no occupancy, the old times; latency alone overlaps freely."""
    sched = build("gpipe", 2, 2)
    assert simulate(sched, two_ranks(5.0, INF)).starts == ((0.0, 1.0, 5.0, 7.0),
                                                           (1.0, 2.0, 3.0, 5.0))
    # latency 2: both forwards are in flight at once (arrive 3 and 4), not one after the other
    assert simulate(sched, two_ranks(5.0, INF, 2.0)).starts == ((0.0, 1.0, 9.0, 11.0),
                                                                (3.0, 4.0, 5.0, 7.0))


def test_latency_does_not_hold_the_link() -> None:
    """bytes / bw = 1, latency 3: F0 holds the link 1..2 and arrives 5; F1 holds it 2..3 and
    arrives 6 (not 9: the link is free again once the data has left it)."""
    trace = simulate(build("gpipe", 2, 2), two_ranks(1.0, 1.0, 3.0))
    assert trace.starts[1][:2] == (5.0, 6.0)


def test_opposite_directions_do_not_contend() -> None:
    """1F1B, p = 2, m = 2, bytes / bw = 5: F1 holds 0->1 during 6..11 while BW0's gradient holds
    1->0 during 9..14; sharing one link would delay the gradient to 11..16."""
    trace = simulate(build("1f1b", 2, 2), two_ranks(5.0, 1.0))
    assert trace.starts == ((0.0, 1.0, 14.0, 19.0), (6.0, 7.0, 11.0, 12.0))
    assert trace.metrics().makespan == 21.0


def fork(gang: bool, bandwidth: float) -> tuple[tuple[float, ...], ...]:
    """Stage 0 feeds stages 1 and 2 (out_bytes 5, two micro-batches): both on rank 1, or a gang
    on ranks 1 and 2 (explicit deps); the start times."""
    graph = StageGraph(3, ((0, 1), (0, 2)), ((1, 2),) if gang else (),
                       (("F",),) if gang else ())
    ranks = (0, 1, 2) if gang else (0, 1, 1)
    p = max(ranks) + 1
    per_rank: list[list[Op]] = [[] for _ in range(p)]
    for mb in range(2):
        for s in range(3):
            per_rank[ranks[s]].append(Op("F", s, mb))
    stage = StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, out_bytes=5.0)
    comm = Comm(((0.0,) * p,) * p, ((bandwidth,) * p,) * p)
    sched = Schedule.build(per_rank, Placement(ranks, p), 2, graph, "")
    return simulate(sched, CostModel((stage,) * 3, comm)).starts


def test_one_output_goes_once_to_a_rank_that_consumes_it_twice() -> None:
    """Stages 1 and 2 on rank 1 share F0's message (link 1..6, then 6..11 for mb 1); two
    messages would push stage 2 of mb 0 to 11."""
    assert fork(False, INF) == ((0.0, 1.0), (1.0, 2.0, 3.0, 4.0))
    assert fork(False, 1.0) == ((0.0, 1.0), (6.0, 7.0, 11.0, 12.0))


def test_gang_deps_serialize_on_each_link() -> None:
    """A gang on ranks 1 and 2 (explicit deps): links 0->1 and 0->2 each carry mb 0 during
    1..6 and mb 1 during 6..11, so the gang starts at 6 and 11 (the pure delay gave 1, 2)."""
    assert fork(True, INF) == ((0.0, 1.0), (1.0, 2.0), (1.0, 2.0))
    assert fork(True, 1.0) == ((0.0, 1.0), (6.0, 11.0), (6.0, 11.0))


# --- brute force ------------------------------------------------------------------------------

def reference(sched: Schedule, cost: CostModel) -> dict[Op, float]:
    """Start times by fixed-point iteration, for a linear placement (stage s on rank s, every
    op on the compute stream). Each op starts after the previous op of its rank ends and after
    its inputs arrive: F(s) needs F(s-1) (out_bytes of s-1), B/BW(s) need F(s) and B/BW(s+1)
    (out_bytes of s), W(s) needs B(s). A cross-rank input is a message; the messages of the
    link a->b queue in rank a's op order, each holding the link for bytes / bandwidth from the
    later of its producer's end and the previous message's release, arriving latency later."""
    S = sched.num_stages
    ops = [op for rank in sched.ranks for op in rank]
    present = set(ops)
    dur = {op: cost.stage(op.stage).time(op.kind) for op in ops}

    def inputs(op: Op) -> list[tuple[Op, int]]:
        """(producer, stage whose out_bytes it carries)."""
        k, s, mb = op
        if k == "F":
            return [(Op("F", s - 1, mb), s - 1)] if s > 0 else []
        if k == "W":
            return [(Op("B", s, mb), s)]
        back = [Op(b, s + 1, mb) for b in ("B", "BW") if Op(b, s + 1, mb) in present]
        return [(Op("F", s, mb), s)] + ([(back[0], s)] if s < S - 1 else [])

    queues: dict[tuple[int, int], list[tuple[Op, int]]] = {}  # link -> messages in send order
    for rank in sched.ranks:
        for op in rank:
            for consumer in ops:
                for prod, carries in inputs(consumer):
                    if prod == op and prod.stage != consumer.stage:
                        queue = queues.setdefault((prod.stage, consumer.stage), [])
                        if (prod, carries) not in queue:
                            queue.append((prod, carries))
    start = dict.fromkeys(ops, 0.0)
    while True:
        end = {op: start[op] + dur[op] for op in ops}
        arrive = {}
        for (a, b), queue in queues.items():
            lat, bw = cost.comm.latency[a][b], cost.comm.bandwidth[a][b]
            free = 0.0
            for prod, carries in queue:
                free = max(end[prod], free) + cost.stage(carries).out_bytes / bw
                arrive[(prod, b)] = free + lat
        new = {}
        for rank in sched.ranks:
            prev = 0.0
            for op in rank:
                t = max([prev] + [arrive[(d, op.stage)] if d.stage != op.stage else end[d]
                                  for d, _ in inputs(op)])
                new[op] = t
                prev = t + dur[op]
        if new == start:
            return start
        start = new


def random_case(rng: random.Random) -> tuple[Schedule, CostModel]:
    """A linear schedule with random p, m, stage times and finite links."""
    name = rng.choice(["gpipe", "1f1b", "zb-h1"])
    p, m = rng.randint(2, 4), rng.randint(1, 6)
    sched = build(name, p, m)
    stages = tuple(StageCost({k: float(rng.randint(1, 4)) for k in "FBW"},
                             out_bytes=float(rng.randint(0, 8))) for _ in range(p))
    lat = tuple(tuple(float(rng.randint(0, 3)) for _ in range(p)) for _ in range(p))
    bw = tuple(tuple(rng.choice([0.5, 1.0, 2.0, 4.0, INF]) for _ in range(p)) for _ in range(p))
    return sched, CostModel(stages, Comm(lat, bw))


@pytest.mark.parametrize("seed", range(50))
def test_matches_brute_force_reference(seed: int) -> None:
    rng = random.Random(seed)
    sched, cost = random_case(rng)
    assert sched.placement.stage_rank == tuple(range(sched.num_ranks))
    trace = simulate(sched, cost)
    want = reference(sched, cost)
    for r, rank in enumerate(sched.ranks):
        assert trace.starts[r] == pytest.approx(tuple(want[op] for op in rank), abs=1e-9)
    makespan = max(want[op] + cost.stage(op.stage).time(op.kind) for op in want)
    assert trace.metrics().makespan == pytest.approx(makespan, abs=1e-9)


@pytest.mark.parametrize("seed", range(0, 50, 5))
def test_lowering_keeps_the_timing_under_contention(seed: int) -> None:
    """With SEND/RECV ops the receive carries the message (sent once, by the send), so the
    lowered schedule takes exactly as long as the compute-only one."""
    from flexpipe.ir.lower import lower

    sched, cost = random_case(random.Random(seed))
    assert simulate(lower(sched), cost).metrics().makespan == pytest.approx(
        simulate(sched, cost).metrics().makespan, abs=1e-9)
