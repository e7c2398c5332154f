"""The lowering pass: sends and receives only across ranks, placed so every library schedule
stays valid (no deadlock) and the input is never changed."""

from __future__ import annotations

import pytest

from flexpipe.ir.lower import lower
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules import registry
from flexpipe.sim.validate import validate


def _build(name: str, p: int, m: int) -> Schedule:
    """Library schedule ``name`` (v = 2 where it takes chunks); skipped where the family is not
    defined (DualPipe at an odd p)."""
    entry = registry.library()[name]
    if not entry.builds(p, m):
        pytest.skip(f"{name} is not defined at p = {p}, m = {m}")
    params = dict(entry.params)
    return registry.build(name, p, m, **({"v": 2} if "v" in params else {}))


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("name", registry.names())
def test_lowered_library_schedules_are_valid(name: str, p: int) -> None:
    schedule = _build(name, p, 2 * p)
    lowered = lower(schedule)
    assert validate(lowered) == []
    compute = [[op for op in ops if not op.kind.startswith(("SEND_", "RECV_"))]
               for ops in lowered.ranks]
    assert compute == [list(ops) for ops in schedule.ranks]
    assert lower(lowered) == lowered  # idempotent


def test_1f1b_two_ranks_exact() -> None:
    lowered = lower(_build("1f1b", 2, 2))
    assert [str(op) for op in lowered.ranks[0]] == [
        "0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0BW0", "0RECV_B1", "0BW1"]
    assert [str(op) for op in lowered.ranks[1]] == [
        "1RECV_F0", "1F0", "1BW0", "1SEND_B0", "1RECV_F1", "1F1", "1BW1", "1SEND_B1"]


def test_same_rank_stages_hand_over_locally() -> None:
    lowered = lower(_build("zb-v", 2, 2))
    comm = {op for ops in lowered.ranks for op in ops if op.kind.startswith(("SEND", "RECV"))}
    # V placement: stages 1 and 2 share rank 1, so nothing is sent between them
    assert Op("SEND_F", 1, 0) not in comm and Op("RECV_F", 2, 0) not in comm
    assert Op("SEND_F", 0, 0) in comm and Op("RECV_F", 3, 0) in comm
    assert Op("SEND_B", 3, 0) in comm and Op("RECV_B", 2, 0) in comm


def test_single_rank_gets_no_communication() -> None:
    schedule = _build("interleaved-1f1b", 1, 3)
    assert lower(schedule).ranks == schedule.ranks
    assert Placement.linear(1).num_ranks == 1
