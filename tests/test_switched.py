"""Cold times after a stage switch (``StageCost.cold``, ``switched_time``): a compute op takes
its stage's cold time when another stage's compute op ran on its rank since the previous op of
its kind and stage (the first of its kind and stage: when it follows another stage's), every
other op its plain time, checked op by op against a brute-force walk of the schedule; without
cold times every timeline is as before; the times derive, merge, scale, round and travel
through cost files like the plain ones, and a bad cold table is refused by key."""

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
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import cost_key
from flexpipe.search.costs import _scaled
from flexpipe.search.exact import integer_cost
from flexpipe.sim import simulate
from flexpipe.specs import load

NAMES = ("1f1b", "zb-h1", "zb-v", "v-half", "v-min", "interleaved-1f1b", "bfs", "gpipe")


def _cold(cost: CostModel, extra: float) -> CostModel:
    """``cost`` with every stage's F, B, W, BW ``extra`` longer after a switch."""
    stages = tuple(replace(s, cold={k: s.time(k) + extra for k in ("F", "B", "W", "BW")})
                   for s in cost.stages)
    return CostModel(stages, cost.comm, cost.edges)


def _switches(sched: Schedule) -> list[list[bool]]:
    """Per rank, per op: a compute op that runs cold (brute force over the op lists): another
    stage's compute op ran on the rank after the previous op of its kind and stage, or, where
    it is the first of its kind and stage, just before it."""
    out = []
    for ops in sched.ranks:
        row = []
        computes = [op for op in ops if KINDS[op.kind].stream == "compute"]
        for op in ops:
            if KINDS[op.kind].stream != "compute":
                row.append(False)
                continue
            at = computes.index(op)
            before = [o for o in computes[:at] if (o.kind, o.stage) == (op.kind, op.stage)]
            start = computes.index(before[-1]) + 1 if before else max(at - 1, 0)
            row.append(any(o.stage != op.stage for o in computes[start:at]))
        out.append(row)
    return out


def test_a_row_of_one_stage_runs_hot_after_its_first() -> None:
    """Looped breadth-first runs one stage's forwards in a row: the first after the other
    stage's is cold, the rest of the row hot (the caches hold that stage again)."""
    sched = load("bfs", 2, 4)
    plain = CostModel.uniform(sched.num_stages, 2, f=1.0, b=1.0, w=1.0)
    trace = simulate(sched, _cold(plain, 0.5))
    ops = sched.ranks[0]
    rows = [i for i in range(1, len(ops) - 1) if ops[i - 1].stage != ops[i].stage
            and (ops[i].kind, ops[i].stage) == (ops[i + 1].kind, ops[i + 1].stage)]
    assert rows, [str(op) for op in ops]
    for i in rows:
        dur = [trace.ends[0][j] - trace.starts[0][j] for j in (i, i + 1)]
        hot = plain.stage(ops[i].stage).time(ops[i].kind)
        assert dur == pytest.approx([hot + 0.5, hot]), (i, ops[i])


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(NAMES), st.integers(2, 4), st.integers(1, 3),
       st.floats(0.1, 2.0), st.booleans())
def test_ops_after_a_switch_take_their_cold_time(name: str, p: int, k: int, extra: float,
                                                 lowered: bool) -> None:
    sched = load(name, p, p * k)
    sched = lower(sched) if lowered else sched
    plain = CostModel.uniform(sched.num_stages, p, f=1.0, b=1.2, w=0.7, comm=0.1)
    trace = simulate(sched, _cold(plain, extra))
    for r, (ops, flags) in enumerate(zip(sched.ranks, _switches(sched), strict=True)):
        for i, (op, switched) in enumerate(zip(ops, flags, strict=True)):
            if KINDS[op.kind].stream != "compute":
                continue
            stage = plain.stage(op.stage)
            want = stage.time(op.kind) + (extra if switched else 0.0)
            assert trace.ends[r][i] - trace.starts[r][i] == pytest.approx(want), (r, i, op)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
def test_one_stage_per_rank_never_switches(name: str) -> None:
    sched = load(name, 4, 8)
    plain = CostModel.uniform(sched.num_stages, 4, f=1.0, b=1.0, w=1.0, comm=0.2)
    hot, cold = simulate(sched, plain), simulate(sched, _cold(plain, 5.0))
    assert (hot.starts, hot.ends) == (cold.starts, cold.ends)


def test_a_v_shape_pays_for_its_switches() -> None:
    sched = load("zb-v", 2, 8)
    plain = CostModel.uniform(sched.num_stages, 2, f=1.0, b=1.0, w=1.0)
    hot = simulate(sched, plain).metrics().makespan
    assert simulate(sched, _cold(plain, 0.5)).metrics().makespan > hot


def test_switched_time_derives_like_time() -> None:
    st_ = StageCost({"F": 1.0, "B": 2.0, "W": 3.0, "SR": 0.5}, cold={"F": 1.5, "B": 2.5})
    assert st_.switched_time("F") == 1.5 and st_.switched_time("W") == 3.0
    assert st_.switched_time("BW") == 2.5 + 3.0  # B + W, each cold where given
    assert st_.switched_time("R") == 1.5  # R is F
    assert st_.switched_time("SR") == 0.5
    with pytest.raises(ConfigError, match="no time 'XX'"):
        st_.switched_time("XX")
    with pytest.raises(ConfigError, match="cold time 'F'"):
        StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, cold={"F": -1.0})


def test_cold_times_merge_scale_round_and_key() -> None:
    a = StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, cold={"F": 2.0})
    b = StageCost({"F": 3.0, "B": 1.0, "W": 1.0})
    merged = merge_stages([a, b])
    assert merged.cold == {"F": 5.0} and merged.times["F"] == 4.0  # all the stage's data cold
    assert _scaled(a, 0.5).cold == {"F": 1.0}
    assert integer_cost(CostModel.uniform(1, 1), 1.0).stage(0).cold == {}
    cost = CostModel((a,), CostModel.uniform(1, 1).comm)
    assert integer_cost(cost, 10.0).stage(0).cold == {"F": 20.0}
    assert cost_key(cost) != cost_key(CostModel((replace(a, cold={}),), cost.comm))


def test_cold_times_travel_through_cost_files(tmp_path: Path) -> None:
    stage = StageCost({"F": 1.0, "B": 2.0, "W": 3.0}, act=2.0, cold={"F": 1.25, "W": 3.5})
    cost = CostModel((stage, StageCost({"F": 1.0, "B": 1.0, "W": 1.0})),
                     CostModel.uniform(2, 2).comm)
    data = cost_to_dict(cost)
    assert data["stages"][0]["cold"] == {"F": 1.25, "W": 3.5} and "cold" not in data["stages"][1]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    assert load_cost(path) == cost
    merged = cost_from_dict({"num_stages": 2, "default": {"F": 1, "B": 1, "W": 1,
                                                           "cold": {"F": 2}},
                             "stages": [{}, {"cold": {"B": 3}}]})
    assert merged.stage(0).cold == {"F": 2.0} and merged.stage(1).cold == {"F": 2.0, "B": 3.0}


@pytest.mark.parametrize(("table", "message"), [
    ({"cold": {"f": 1}}, r"stages\[0\]\.cold\.f: unknown key; did you mean 'F'"),
    ({"cold": {"act": 1}}, r"stages\[0\]\.cold\.act: unknown key"),
    ({"cold": {"F": -2}}, r"stages\[0\]\.cold\.F"),
    ({"cold": 3}, r"stages\[0\]\.cold"),
    ({"cold": {"cold": {"F": 1}}}, r"stages\[0\]\.cold\.cold: unknown key"),
])
def test_a_bad_cold_table_is_refused_by_key(table: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cost_from_dict({"default": {"F": 1, "B": 1, "W": 1}, "stages": [table]})
