"""What a consumer's W holds of its producer's outputs on the same rank (``Edge.kept_w``) is
counted once: with it, every rank's memory curve is the curve without it less ``kept_w``
exactly from the consumer's B to the producer's backward or the consumer's W, whichever ends
first (brute force over the ops' times), and the same elsewhere; a consumer on another rank
changes nothing; the field travels through cost files."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexpipe.cost.io import cost_from_dict, cost_to_dict
from flexpipe.cost.model import CostModel, Edge
from flexpipe.sim import simulate
from flexpipe.specs import load

KEPT_W = 0.25


def _level(curve: tuple[tuple[float, float], ...], t: float) -> float:
    """The curve's value just after time ``t`` (its last step at or before ``t``)."""
    return [v for at, v in curve if at <= t][-1]


def _spans(sched: object, trace: object, edge: Edge) -> list[tuple[float, float]]:
    """Per micro-batch, brute force: (end of the consumer's B, the earlier end of the
    producer's backward and the consumer's W), on the consumer's rank."""
    ends = {}
    for r, ops in enumerate(sched.ranks):  # type: ignore[attr-defined]
        for i, op in enumerate(ops):
            ends[(op.kind, op.stage, op.mb)] = trace.ends[r][i]  # type: ignore[attr-defined]
    out = []
    for mb in range(sched.microbatches):  # type: ignore[attr-defined]
        w = ends.get(("W", edge.consumer, mb))
        back = ends.get(("B", edge.producer, mb), ends.get(("BW", edge.producer, mb)))
        if w is not None:
            out.append((ends[("B", edge.consumer, mb)], min(w, back)))
    return out


@pytest.mark.parametrize(("name", "p", "m"), [("zb-v", 2, 4), ("zb-v", 3, 6), ("v-half", 2, 4),
                                               ("v-min", 3, 6)])
def test_the_handed_over_bytes_count_once_between_the_two_holders(name: str, p: int,
                                                                   m: int) -> None:
    sched = load(name, p, m)
    plain = CostModel.uniform(sched.num_stages, p, f=1.0, b=1.0, w=1.0)
    edge = Edge(p - 1, p, 1.0, 1.0, 0.5, KEPT_W)  # the V's turn: stages p-1 and p on rank p-1
    assert sched.placement.stage_rank[p - 1] == sched.placement.stage_rank[p]
    base = simulate(sched, plain)
    held = simulate(sched, replace(plain, edges=(replace(edge, kept_w=0.0),)))
    once = simulate(sched, replace(plain, edges=(edge,)))
    assert (held.starts, held.ends) == (once.starts, once.ends) == (base.starts, base.ends)
    rank = sched.placement.stage_rank[p]
    spans = _spans(sched, once, edge)
    assert spans and all(a < b for a, b in spans)
    times = sorted({t for t, _ in held.memory[rank]} | {t for t, _ in once.memory[rank]})
    for t in times:
        inside = any(a <= t < b for a, b in spans)
        want = _level(held.memory[rank], t) - (KEPT_W if inside else 0.0)
        assert _level(once.memory[rank], t) == pytest.approx(want), (t, spans)
    for r in range(p):
        if r != rank:
            assert once.memory[r] == held.memory[r]


@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_a_consumer_on_another_rank_changes_nothing(name: str) -> None:
    sched = load(name, 2, 4)  # stages 0 -> 1 on two ranks
    plain = CostModel.uniform(2, 2, f=1.0, b=1.0, w=1.0)
    with_edge = replace(plain, edges=(Edge(0, 1, 1.0, 1.0, 0.5, KEPT_W),))
    assert simulate(sched, with_edge).memory == simulate(
        sched, replace(plain, edges=(Edge(0, 1, 1.0, 1.0, 0.5),))).memory


def test_kept_w_travels_through_cost_files() -> None:
    cost = replace(CostModel.uniform(2, 1), edges=(Edge(0, 1, 8.0, 8.0, 4.0, 2.0),))
    data = cost_to_dict(cost)
    assert data["edges"][0]["kept_w_bytes"] == 2.0
    assert cost_from_dict(data).edges == cost.edges
