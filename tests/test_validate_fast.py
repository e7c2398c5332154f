"""The validator's fast path (``flexpipe.sim.quick``) against the full checks it stands in for:
``sound`` never vouches for a schedule the full structural check would flag, it vouches for
every library schedule, the skipped transport check would have found nothing, and validation
stays linear: a 4000-rank chain and a 200,000-op two-rank schedule in seconds."""

from __future__ import annotations

import random
import time

import pytest

from flexpipe.errors import ConfigError
from flexpipe.ir import Op, Placement, Schedule
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.lower import COMM_KINDS, lower
from flexpipe.schedules.registry import build, names
from flexpipe.sim import quick
from flexpipe.sim.engine import simulate
from flexpipe.sim.pairs import pair_violations
from flexpipe.sim.quick import sound, transport_implied
from flexpipe.sim.unit import zero_cost
from flexpipe.sim.validate import _structure, validate


def _full(schedule: Schedule) -> list[str]:
    """The rules the validator reported before the fast path: structure, then a zero-time
    simulation, then the transport on the lowering."""
    found = _structure(schedule, KINDS)
    if found:
        return sorted(v.rule for v in found)
    try:
        simulate(schedule, zero_cost(schedule, ["BW", "R", "OFFLOAD", "RELOAD", "SR"]))
    except Exception as exc:  # noqa: BLE001 - the test compares rule names only
        return sorted(v.rule for v in getattr(exc, "violations", [])) or [repr(exc)]
    return sorted(v.rule for v in pair_violations(lower(schedule), KINDS))


@pytest.mark.parametrize("name", names())
def test_fast_path_vouches_for_every_library_schedule(name: str) -> None:
    for p, m in ((2, 3), (4, 8)):
        schedule = build(name, p, max(m, _least(name, p)))
        runs = any(quick._spans_runs(KINDS, k) for k in schedule.kinds())  # not decided
        assert (sound(schedule, KINDS) is not None) != runs, name
        assert _full(schedule) == []


def _least(name: str, p: int) -> int:
    """The fewest micro-batches library family ``name`` takes at p ranks."""
    from flexpipe.schedules.registry import library

    rule = library()[name].least_m
    return rule(p) if rule is not None else 1


def _defined_at(name: str, p: int) -> bool:
    """Whether library family ``name`` is defined at p ranks."""
    from flexpipe.schedules.registry import library

    rule = library()[name].ranks_ok
    return rule is None or rule(p)


def _mutants(schedule: Schedule, rng: random.Random, count: int) -> list[Schedule]:
    """Schedules one edit away: two ops of a rank swapped, an op dropped, moved to another
    rank, or given another micro-batch or stage."""
    out = []
    for _ in range(count):
        ranks = [list(ops) for ops in schedule.ranks]
        r = rng.randrange(len(ranks))
        ops = ranks[r]
        i, j = rng.randrange(len(ops)), rng.randrange(len(ops))
        edit = rng.randrange(5)
        if edit == 0:
            ops[i], ops[j] = ops[j], ops[i]
        elif edit == 1:
            del ops[i]
        elif edit == 2:
            ranks[(r + 1) % len(ranks)].append(ops.pop(i))
        elif edit == 3:
            ops[i] = Op(ops[i].kind, ops[i].stage, (ops[i].mb + 1) % schedule.microbatches)
        else:
            ops[i] = Op(ops[i].kind, (ops[i].stage + 1) % schedule.num_stages, ops[i].mb)
        out.append(schedule.with_ranks(ranks))
    return out


@pytest.mark.parametrize("name", names())
def test_fast_and_full_checks_agree_on_broken_schedules(name: str) -> None:
    rng = random.Random(name)
    p = 3 if _defined_at(name, 3) else 4  # DualPipe: even p only
    base = build(name, p, max(4, _least(name, p))).flattened()  # mutants move single ops
    for mutant in _mutants(base, rng, 60):
        if sound(mutant, KINDS) is not None:
            assert _structure(mutant, KINDS) == [], mutant.to_text()
        assert sorted(v.rule for v in validate(mutant)) == _full(mutant), mutant.to_text()


def test_transport_rule_is_only_skipped_for_chains_without_comm_ops() -> None:
    chain = build("1f1b", 4, 4)
    assert transport_implied(chain, COMM_KINDS)
    assert not transport_implied(lower(chain), COMM_KINDS)
    fork = Schedule.build([[]] * 3, Placement.linear(3), 1, graph=_fork())
    assert not transport_implied(fork, COMM_KINDS)


def _fork():  # type: ignore[no-untyped-def]
    from flexpipe.ir.graph import StageGraph

    return StageGraph(3, ((0, 1), (0, 2)))


def test_size_guard_names_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quick, "MAX_OPS", 100)
    with pytest.raises(ConfigError, match="at most 100"):
        validate(build("1f1b", 4, 16))
    monkeypatch.setattr(quick, "MAX_OPS", 10**9)
    monkeypatch.setattr(quick, "MAX_IDS", 1000)
    with pytest.raises(ConfigError, match="possible ops"):
        simulate(build("1f1b", 4, 200))


def test_validation_is_linear_in_ranks_and_ops() -> None:
    """Before the fast path: a 2000-rank chain took 21 s and 200,000 ops 29 s (quadratic in
    ranks); now 0.7 s and 1.7 s under a load of 8. The bounds leave room for a loaded machine."""
    chain = build("1f1b", 3000, 1)
    t0 = time.process_time()
    assert validate(chain) == []
    assert time.process_time() - t0 < 5.0
    long = build("1f1b", 2, 50_000)
    t0 = time.process_time()
    assert validate(long) == []
    assert time.process_time() - t0 < 5.0
