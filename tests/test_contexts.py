"""A pass's time by context (``StageCost.fused``, ``after_w``, with ``cold``): a hot compute op
of a micro-batch whose backward is fused (no B) takes its ``fused`` time, one right after its
own stage's W its ``after_w`` time, a cold one its ``cold`` time, every other op its plain
time, checked op by op against a brute-force walk of the schedule; the tables merge, scale,
round, key and travel through cost files like ``cold``, and a bad one is refused by key."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.io import cost_from_dict, cost_to_dict, load_cost
from flexpipe.cost.model import CostModel, StageCost, merge_stages
from flexpipe.errors import ConfigError
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.lower import lower
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import cost_key
from flexpipe.search.costs import _scaled
from flexpipe.search.exact import integer_cost
from flexpipe.sim import simulate
from flexpipe.specs import load
from test_switched import NAMES, _switches


def _contexts(cost: CostModel, cold: float, fused: float, after: float) -> CostModel:
    """``cost`` with every stage's passes ``cold`` longer when cold, its F ``fused`` longer for
    a fused micro-batch and ``after`` longer right after its own W."""
    stages = tuple(replace(s, cold={k: s.time(k) + cold for k in ("F", "B", "W", "BW")},
                           fused={"F": s.time("F") + fused},
                           after_w={"F": s.time("F") + after})
                   for s in cost.stages)
    return CostModel(stages, cost.comm, cost.edges)


def _context_of(sched: Schedule) -> list[list[str | None]]:
    """Per rank, per op, brute force: "cold" where ``test_switched`` finds it cold; else
    "fused" when no rank runs a B of its stage and micro-batch; else "after_w" when the rank's
    previous compute op is its stage's W; else None (and None for transfers)."""
    split = {(op.stage, op.mb) for ops in sched.ranks for op in ops if op.kind == "B"}
    out = []
    for ops, cold in zip(sched.ranks, _switches(sched), strict=True):
        row: list[str | None] = []
        prev: Op | None = None
        for op, is_cold in zip(ops, cold, strict=True):
            if KINDS[op.kind].stream != "compute":
                row.append(None)
                continue
            after = prev is not None and (prev.kind, prev.stage) == ("W", op.stage)
            row.append("cold" if is_cold else "fused" if (op.stage, op.mb) not in split
                       else "after_w" if after else None)
            prev = op
        out.append(row)
    return out


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(NAMES + ("zb-h2", "1f1b-recompute")), st.integers(2, 4),
       st.integers(1, 3), st.booleans())
def test_each_op_takes_the_time_of_its_context(name: str, p: int, k: int,
                                               lowered: bool) -> None:
    sched = load(name, p, p * k)
    sched = lower(sched) if lowered else sched
    cost = _contexts(CostModel.uniform(sched.num_stages, p, f=1.0, b=1.2, w=0.7, comm=0.1),
                     0.5, -0.25, 0.125)
    trace = simulate(sched, cost)
    seen = set()
    for r, (ops, contexts) in enumerate(zip(sched.ranks, _context_of(sched), strict=True)):
        for i, (op, context) in enumerate(zip(ops, contexts, strict=True)):
            if KINDS[op.kind].stream != "compute":
                continue
            stage = cost.stage(op.stage)
            want = KINDS[op.kind].duration(stage.timer(context), stage.has_time)
            assert trace.ends[r][i] - trace.starts[r][i] == pytest.approx(want), (r, i, op)
            seen.add(context)
    if name == "1f1b":
        assert "fused" in seen
    if name == "zb-h1" and k > 1:
        assert "after_w" in seen


def test_a_fused_schedule_gains_what_its_forward_does_not_record() -> None:
    """1F1B runs every F fused; ZB-H1 none, and its forwards after a W take longer."""
    plain = CostModel.uniform(4, 4, f=1.0, b=1.0, w=1.0)
    both = _contexts(plain, 0.0, -0.1, 0.2)
    one, zb = load("1f1b", 4, 8), load("zb-h1", 4, 8)
    assert simulate(one, both).metrics().makespan < simulate(one, plain).metrics().makespan
    assert simulate(zb, both).metrics().makespan > simulate(zb, plain).metrics().makespan
    # only ZB-H1's after_w, only 1F1B's fused table is read
    assert simulate(zb, _contexts(plain, 0.0, -0.1, 0.0)).ends == simulate(zb, plain).ends
    assert simulate(one, _contexts(plain, 0.0, 0.0, 0.2)).ends == simulate(one, plain).ends


def test_timer_reads_each_context() -> None:
    stage = StageCost({"F": 1.0, "B": 2.0, "W": 3.0}, cold={"F": 1.5}, fused={"F": 0.75},
                      after_w={"F": 1.25})
    assert [stage.timer(t)("F") for t in (None, "cold", "fused", "after_w")] == \
        [1.0, 1.5, 0.75, 1.25]
    assert stage.timer("fused")("B") == 2.0 and stage.timer("cold")("BW") == 5.0
    assert stage.timer("after_w")("R") == 1.25  # a recompute is a forward
    with pytest.raises(ConfigError, match="fused time 'F'"):
        StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, fused={"F": -1.0})


def test_context_tables_merge_scale_round_and_key() -> None:
    a = StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, fused={"F": 0.5}, after_w={"F": 2.0})
    b = StageCost({"F": 3.0, "B": 1.0, "W": 1.0})
    merged = merge_stages([a, b])
    assert (merged.fused, merged.after_w) == ({"F": 3.5}, {"F": 5.0})
    assert (_scaled(a, 0.5).fused, _scaled(a, 0.5).after_w) == ({"F": 0.25}, {"F": 1.0})
    cost = CostModel((a,), CostModel.uniform(1, 1).comm)
    assert integer_cost(cost, 10.0).stage(0).after_w == {"F": 20.0}
    for table in ("fused", "after_w"):
        assert cost_key(cost) != cost_key(CostModel((replace(a, **{table: {}}),), cost.comm))


def test_context_tables_travel_through_cost_files(tmp_path: Path) -> None:
    stage = StageCost({"F": 1.0, "B": 2.0, "W": 3.0}, fused={"F": 0.75}, after_w={"F": 1.25})
    cost = CostModel((stage, StageCost({"F": 1.0, "B": 1.0, "W": 1.0})),
                     CostModel.uniform(2, 2).comm)
    data = cost_to_dict(cost)
    assert data["stages"][0]["fused"] == {"F": 0.75} and "after_w" not in data["stages"][1]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    assert load_cost(path) == cost
    merged = cost_from_dict({"num_stages": 2, "default": {"F": 1, "B": 1, "W": 1,
                                                           "after_w": {"F": 2}},
                             "stages": [{}, {"fused": {"F": 0.5}}]})
    assert merged.stage(1).after_w == {"F": 2.0} and merged.stage(1).fused == {"F": 0.5}


@pytest.mark.parametrize(("table", "message"), [
    ({"fused": {"f": 1}}, r"stages\[0\]\.fused\.f: unknown key; did you mean 'F'"),
    ({"after_w": {"act": 1}}, r"stages\[0\]\.after_w\.act: unknown key"),
    ({"after_w": {"F": -2}}, r"stages\[0\]\.after_w\.F"),
    ({"fused": 3}, r"stages\[0\]\.fused"),
    ({"fused": {"cold": {"F": 1}}}, r"stages\[0\]\.fused\.cold: unknown key"),
    ({"after": {"F": 1}}, r"stages\[0\]\.after: unknown key; did you mean 'after_w'"),
])
def test_a_bad_context_table_is_refused_by_key(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cost_from_dict({"default": {"F": 1, "B": 1, "W": 1}, "stages": [table]})
