"""The validator: one test per rule, valid library schedules, and random broken schedules that
only ever produce violations (never a crash)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError, DeadlockError, ValidationError, Violation
from flexpipe.ir import BW, B, F, Op, Placement, R, Schedule, W
from flexpipe.schedules.registry import build, names
from flexpipe.sim.validate import check, count_rules, validate


def two_stage(rank0: list[Op], rank1: list[Op], m: int = 2) -> Schedule:
    """A 2-rank, 2-stage chain schedule with the given op orders."""
    return Schedule.build([rank0, rank1], Placement.linear(2), m)


GOOD0 = [F(0, 0), F(0, 1), BW(0, 0), BW(0, 1)]
GOOD1 = [F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)]


def rules(violations: list[Violation]) -> set[str]:
    return {v.rule for v in violations}


def only(violations: list[Violation], rule: str) -> Violation:
    assert [v.rule for v in violations] == [rule], [str(v) for v in violations]
    return violations[0]


# --- valid schedules --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 13])
def test_classic_library_schedules_are_valid(name: str, p: int, m: int) -> None:
    assert validate(build(name, p, m)) == []


@pytest.mark.parametrize("name", names())
def test_every_library_schedule_is_valid(name: str) -> None:
    for p, m in ((2, 4), (4, 8)):
        schedule = build(name, p, m)
        assert validate(schedule) == [], name
        check(schedule)


def test_good_schedule_passes_check_and_memory_limit() -> None:
    schedule = build("1f1b", 4, 8)
    check(schedule, mem_limit=4)
    check(schedule, mem_limit=[4, 3, 2, 1])


# --- one test per structural rule -------------------------------------------------------------

def test_unknown_kind() -> None:
    v = only(validate(two_stage([*GOOD0, Op("ZAP", 0, 0)], GOOD1)), "unknown-kind")
    assert (v.rank, v.position, v.op) == (0, 4, "0ZAP0") and "ZAP" in v.reason


def test_stage_and_microbatch_out_of_range() -> None:
    found = validate(two_stage([*GOOD0, F(0, 7)], [*GOOD1, F(5, 0)]))
    assert [v.rule for v in found] == ["range", "range"]
    assert "micro-batch 7" in found[0].reason and "stage 5" in found[1].reason
    assert (found[1].rank, found[1].position) == (1, 4)


def test_op_on_the_wrong_rank() -> None:
    r0 = [F(0, 0), F(0, 1), BW(0, 0), BW(0, 1), F(1, 1)]
    r1 = [F(1, 0), BW(1, 0), BW(1, 1)]
    v = only(validate(two_stage(r0, r1)), "placement")
    assert (v.rank, v.position, v.op) == (0, 4, "1F1")
    assert "placed on rank 1" in v.reason and "[1F1]" in v.context


def test_duplicate_op() -> None:
    v = only(validate(two_stage([*GOOD0, F(0, 1)], GOOD1)), "duplicate")
    assert (v.rank, v.position) == (0, 4) and "position 1" in v.reason


@pytest.mark.parametrize("rank0, what", [
    ([F(0, 0), F(0, 1), BW(0, 0)], "no backward"),
    ([F(0, 0), BW(0, 0), BW(0, 1)], "no forward"),
    ([F(0, 0), F(0, 1), BW(0, 0), B(0, 1)], "B but no W"),
    ([F(0, 0), F(0, 1), BW(0, 0), BW(0, 1), W(0, 1)], "both a fused BW"),
])
def test_completeness(rank0: list[Op], what: str) -> None:
    v = only(validate(two_stage(rank0, GOOD1)), "completeness")
    assert what in v.reason and "stage 0 micro-batch 1" in v.reason and v.rank == 0


def test_w_without_b_is_one_violation() -> None:
    found = validate(two_stage([F(0, 0), F(0, 1), BW(0, 0), W(0, 1)], GOOD1))
    v = only(found, "completeness")
    assert "W but no B" in v.reason and v.op == "0B1" and v.position == 3


def test_recompute_without_forward_is_a_missing_dependency() -> None:
    schedule = Schedule.build([[R(0, 0), B(0, 0), W(0, 0)]], Placement.linear(1), 1)
    found = validate(schedule)
    assert rules(found) == {"completeness"}  # the missing F; R's need of it is not repeated
    schedule = Schedule.build([[F(0, 0), BW(0, 0)], [F(1, 0), R(1, 0), BW(1, 0)]],
                              Placement.linear(2), 1)
    assert validate(schedule) == []


def test_a_receive_without_its_send_is_a_pair_order_violation() -> None:
    r1 = [Op("RECV_F", 1, 0), F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)]
    v = only(validate(two_stage(GOOD0, r1)), "pair-order")
    assert (v.rank, v.position, v.op) == (1, 0, "1RECV_F0")
    assert "rank 1 receives F0 0>1 from rank 0, which never sends it" in v.reason


def test_recompute_on_another_rank_is_a_placement_violation() -> None:
    schedule = Schedule.build([[F(0, 0), R(1, 0), BW(0, 0)], [F(1, 0), BW(1, 0)]],
                              Placement.linear(2), 1)
    assert rules(validate(schedule)) == {"placement"}


def test_recompute_after_its_backward_is_an_order_violation() -> None:
    r1 = [F(1, 0), BW(1, 0), R(1, 0), F(1, 1), BW(1, 1)]
    v = only(validate(two_stage(GOOD0, r1)), "order")
    assert (v.rank, v.position, v.op) == (1, 1, "1BW0") and "1R0" in v.reason


def test_dependency_order_within_a_rank() -> None:
    r1 = [BW(1, 0), F(1, 0), F(1, 1), BW(1, 1)]
    v = only(validate(two_stage(GOOD0, r1)), "order")
    assert (v.rank, v.position, v.op) == (1, 0, "1BW0")
    assert "needs 1F0, which comes later on rank 1 (position 1)" in v.reason
    assert "> rank 1: [1BW0] 1F0" in v.context


def test_independent_violations_are_all_reported() -> None:
    r0 = [F(0, 0), F(0, 1), BW(0, 0), Op("ZAP", 0, 0)]
    r1 = [BW(1, 0), F(1, 0), F(1, 1), BW(1, 1), F(1, 1)]
    found = validate(two_stage(r0, r1))
    assert count_rules(found) == {"unknown-kind": 1, "duplicate": 1, "completeness": 1,
                                  "order": 1}
    with pytest.raises(ValidationError) as exc:
        check(two_stage(r0, r1))
    assert len(exc.value.violations) == 4 and "4 violations" in str(exc.value)


# --- deadlock and memory ----------------------------------------------------------------------

def test_real_deadlock_names_the_cycle() -> None:
    r0 = [F(0, 0), BW(0, 0), F(0, 1), BW(0, 1)]  # waits for 1BW0 before sending 0F1
    r1 = [F(1, 1), F(1, 0), BW(1, 0), BW(1, 1)]  # waits for 0F1 before running 1F0
    v = only(validate(two_stage(r0, r1)), "deadlock")
    assert "rank 0 waits at 0BW0 for 1BW0 on rank 1" in v.reason
    assert "rank 1 waits at 1F1 for 0F1 on rank 0" in v.reason
    assert v.context and "[" in v.context
    with pytest.raises(DeadlockError):
        check(two_stage(r0, r1))


def test_deadlock_is_skipped_when_the_structure_is_broken() -> None:
    r0 = [F(0, 0), BW(0, 0), F(0, 1), BW(0, 1), Op("ZAP", 0, 0)]
    r1 = [F(1, 1), F(1, 0), BW(1, 0), BW(1, 1)]
    assert rules(validate(two_stage(r0, r1))) == {"unknown-kind"}


def test_memory_limit_names_rank_and_amount() -> None:
    found = validate(build("1f1b", 4, 8), mem_limit=3)
    v = only(found, "memory")
    assert v.rank == 0 and "exceeds the limit 3 by 1" in v.reason and v.op == "0F3"


def test_memory_limit_per_rank_with_a_cost_model() -> None:
    schedule = build("gpipe", 2, 4)
    cost = CostModel.uniform(2, 2, act=2.0, wact=1.0)
    found = validate(schedule, cost=cost, mem_limit=[100, 5])
    v = only(found, "memory")
    assert v.rank == 1 and "peak memory 8" in v.reason and "by 3" in v.reason


@pytest.mark.parametrize("limit", [-1, float("nan"), [1, 2, 3], "lots", [1, None], True])
def test_bad_memory_limits(limit: object) -> None:
    with pytest.raises(ConfigError, match="memory limit"):
        validate(build("1f1b", 2, 2), mem_limit=limit)  # type: ignore[arg-type]


def test_cost_model_that_does_not_fit_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="stages"):
        validate(build("1f1b", 2, 2), cost=CostModel.uniform(3, 2), mem_limit=10)


# --- fuzz: any op soup gives violations, never a crash ----------------------------------------

OPS = st.builds(Op, st.sampled_from(["F", "B", "W", "BW", "R", "SEND_F", "ZAP"]),
                st.integers(-1, 4), st.integers(-1, 3))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(OPS, max_size=10), min_size=2, max_size=2), st.integers(1, 3))
def test_random_op_soup_never_crashes(ranks: list[list[Op]], m: int) -> None:
    schedule = Schedule.build(ranks, Placement.linear(2), m)
    found = validate(schedule, mem_limit=2.0)
    assert all(isinstance(v, Violation) and v.rule and v.reason for v in found)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["1f1b", "zb-h1", "gpipe"]), st.integers(2, 4), st.integers(1, 5),
       st.data())
def test_swapping_two_ops_never_crashes(name: str, p: int, m: int, data: st.DataObject) -> None:
    schedule = build(name, p, m)
    r = data.draw(st.integers(0, p - 1))
    ops = list(schedule.ranks[r])
    i, j = data.draw(st.integers(0, len(ops) - 1)), data.draw(st.integers(0, len(ops) - 1))
    ops[i], ops[j] = ops[j], ops[i]
    ranks = list(schedule.ranks)
    ranks[r] = tuple(ops)
    found = validate(schedule.with_ranks(ranks))
    assert rules(found) <= {"order", "deadlock"}
