"""Overlapped pairs (``flexpipe.ir.overlap``) and DualPipeV built with them: the pair's rules
with named errors, the text and torch-CSV forms round-trip, lowering keeps a pair together,
the simulator runs a pair in one slot that hides each pass's communication behind the other's
compute, and DualPipeV's bubble and activation memory are DeepSeek's published ones."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError, InfeasibleError, ParseError
from flexpipe.ir.lower import lower
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import pair_time
from flexpipe.ir.text import parse_schedule
from flexpipe.ir.torch_csv import from_torch_csv, to_torch_csv
from flexpipe.schedules.registry import build
from flexpipe.sim.engine import simulate

HEAD = "flexpipe-schedule v1\nranks: 2 stages: 4 microbatches: 2\nplacement: 0 1 1 0\n"


def test_dualpipev_round_trips_through_text_and_torch_csv() -> None:
    for p, m in ((2, 4), (3, 7), (4, 10)):
        sched = build("dualpipev", p, m)
        assert sched.overlaps and parse_schedule(sched.to_text()) == sched
        csv = to_torch_csv(sched)
        assert "OVERLAP_F_B" in csv
        assert from_torch_csv(csv, sched.placement, m, name=sched.name) == sched


@pytest.mark.parametrize("rank0,why", [
    ("0F0 0F1 3F0&3BW0 3F1 3BW1 0BW0 0BW1", "needs its own forward"),
    ("0F0 0F1 3F0&3F1 3BW0 3BW1 0BW0 0BW1", "one forward (F) and one backward"),
    ("0F0 0F1&3F0&3BW0 3F1 3BW1 0BW0 0BW1", "holds two ops"),
])
def test_a_pair_that_cannot_share_a_slot_is_refused_by_name(rank0: str, why: str) -> None:
    text = HEAD + f"rank 0: {rank0}\nrank 1: 1F0 2F0 2BW0 1F1 2F1 2BW1 1BW0 1BW1\n"
    with pytest.raises(ParseError, match=re.escape(why)):
        parse_schedule(text)


def test_a_pair_must_be_listed_together_on_one_rank() -> None:
    sched = build("zb-v", 2, 4)
    far = (Op("F", 0, 0), Op("B", 3, 0))
    with pytest.raises(ConfigError, match="must come right after"):
        sched.with_overlaps([far])
    other_rank = (Op("F", 0, 0), Op("F", 1, 0))
    with pytest.raises(ConfigError, match="right after"):
        sched.with_overlaps([other_rank])


def test_dualpipev_needs_two_micro_batches_per_rank_and_stage() -> None:
    with pytest.raises(InfeasibleError, match="at least 2p = 8"):
        build("dualpipev", 4, 7)


def test_lowering_keeps_each_pair_together_and_the_same_times() -> None:
    sched = build("dualpipev", 4, 10)
    cost = CostModel.uniform(8, 4, f=1.0, b=1.1, w=0.6, comm=0.2,
                             extra={"F_comm": 0.3, "BW_comm": 0.4})
    low = lower(sched)
    for a, b in low.overlaps:
        ops = next(ops for ops in low.ranks if a in ops)
        assert ops.index(b) == ops.index(a) + 1
    assert simulate(low, cost).metrics().makespan == pytest.approx(
        simulate(sched, cost).metrics().makespan)


def test_a_pair_runs_in_one_slot_hiding_each_pass_communication() -> None:
    """Both ops of a pair start and end together; the slot is the longer of the two computes
    summed and the two communications summed (DeepSeek-V3 report, 3.2.1)."""
    sched = build("dualpipev", 2, 4)
    cost = CostModel.uniform(4, 2, f=1.0, b=1.0, w=0.5, extra={"F_comm": 0.4, "BW_comm": 0.6})
    trace = simulate(sched, cost)
    where = {op: (r, i) for r, ops in enumerate(sched.ranks) for i, op in enumerate(ops)}
    slot = pair_time((1.0, 0.4), (1.5, 0.6))
    assert slot == pytest.approx(1.5)
    for a, b in sched.overlaps:
        (r, i), (_, j) = where[a], where[b]
        assert trace.starts[r][i] == trace.starts[r][j]
        assert trace.ends[r][i] - trace.starts[r][i] == pytest.approx(slot)
    flat = simulate(sched.flattened(), cost).metrics().makespan
    assert trace.metrics().makespan < flat  # communication hidden: shorter than one by one


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("fb,w,comm", [(1.0, 1.0, (0.0, 0.0)), (1.0, 0.5, (0.0, 0.0)),
                                       (1.2, 0.3, (0.0, 0.0)), (1.0, 0.8, (0.4, 0.5))])
def test_dualpipev_bubble_is_deepseeks(p: int, fb: float, w: float,
                                       comm: tuple[float, float]) -> None:
    """DeepSeek's table: DualPipeV's bubble is (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages,
    B the full backward of a chunk and F&B the overlapped slot; it holds where a chunk's F and
    B (input gradient) take the same time, as the table's derivation assumes."""
    f = b = fb
    cost = CostModel.uniform(2 * p, p, f=f, b=b, w=w,
                             extra={"F_comm": comm[0], "BW_comm": comm[1]})
    metrics = simulate(build("dualpipev", p, 4 * p), cost).metrics()
    slot = pair_time((f, comm[0]), (b + w, comm[1]))
    bubble = metrics.makespan - min(metrics.busy)
    assert bubble == pytest.approx((p - 1) * (slot + (b + w) - 3 * w))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_dualpipev_holds_pp_plus_one_chunks_of_activations(p: int) -> None:
    """DeepSeek's table: activation per device PP + 1 chunks (PP = 2p stages), against 1F1B's
    PP on a stage each; parameters per device 2x (two stages)."""
    cost = CostModel.uniform(2 * p, p, act=1.0, wact=0.5)
    peak = max(simulate(build("dualpipev", p, 4 * p), cost).metrics().peak_activation)
    assert peak == pytest.approx(2 * p + 1)
    assert build("dualpipev", p, 4 * p).placement.num_stages == 2 * p


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"]),
       st.integers(2, 4), st.integers(0, 2**31), st.data())
def test_any_valid_pairing_round_trips(name: str, p: int, seed: int, data: st.DataObject) -> None:
    """Pair adjacent (F, backward) ops of any library schedule at random: the text and the
    CSV give the same schedule back."""
    sched = build(name, p, 2 * p)
    candidates = [(a, b) for ops in sched.ranks for a, b in zip(ops, ops[1:], strict=False)
                  if {a.kind, b.kind} in ({"F", "B"}, {"F", "BW"}, {"F", "W"})
                  and (a.stage, a.mb) != (b.stage, b.mb)]
    chosen: list[tuple[Op, Op]] = []
    for a, b in candidates:
        if data.draw(st.booleans()) and not any(x in (a, b) for pair in chosen for x in pair):
            chosen.append((a, b))
    paired = sched.with_overlaps(chosen)
    assert parse_schedule(paired.to_text()) == paired
    assert from_torch_csv(to_torch_csv(paired), paired.placement, paired.microbatches,
                          name=paired.name) == paired


def test_a_pair_that_loses_an_op_is_dropped_and_one_split_apart_refused() -> None:
    sched = build("dualpipev", 2, 4)
    forwards = sched.with_ranks([[o for o in ops if o.kind == "F"] for ops in sched.ranks])
    assert not forwards.overlaps
    a, b = sorted(sched.overlaps)[0]
    ops = list(next(ops for ops in sched.ranks if a in ops))
    moved = [o for o in ops if o != b] + [b]  # b no longer right after a
    with pytest.raises(ConfigError, match="must come right after"):
        sched.with_ranks([moved if a in r else r for r in sched.ranks])
