"""The schedule validator: every rule a schedule must keep, each reported as a ``Violation``
with its own ``rule`` name, the rank, position and op, and the schedule printed around it.

Structural rules (checked together; every independent violation is reported):

- ``unknown-kind``: an op whose kind is not registered.
- ``range``: a stage or micro-batch index outside the schedule's counts.
- ``placement``: an op on a rank that does not hold its stage.
- ``duplicate``: the same op twice (at most one of each kind per stage and micro-batch).
- ``completeness``: each stage x micro-batch needs F exactly once and either BW or B and W;
  no B without W, no W without B, no BW together with B or W.
- ``missing-dependency``: an op needs another op that no rank runs (e.g. R without its F).
- ``order``: an op placed after an op on the same rank that needs it (e.g. R after its B).

Rules that need the structure to be sound (skipped when a structural rule fails):

- ``deadlock``: ranks that wait on each other in a cycle; found by the simulator, which names
  the cycle of waits (a zero-time cost model unless a memory check needs real costs).
- ``memory``: with ``mem_limit``, a rank whose simulated peak memory (activations and whatever
  the op kinds move, plus parameters) exceeds the limit; names the rank and the amount over.
- ``pair-order``: the point-to-point transport (``flexpipe.sim.pairs``), on the schedule itself
  when it holds communication ops, else on its lowering: on every rank pair the sends and the
  receives list the same messages in the same order (no tags), and posting them as the runtime
  does cannot deadlock. ``check`` raises ``PairOrderError`` when this is the only problem.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import replace

from flexpipe.cost.limits import LimitLike, MemLimit
from flexpipe.cost.model import CostModel, StageCost
from flexpipe.errors import (
    DeadlockError,
    PairOrderError,
    ValidationError,
    Violation,
)
from flexpipe.ir.around import around
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.ir.lower import COMM_KINDS, lower
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.engine import default_cost, simulate
from flexpipe.sim.pairs import RULE, pair_violations
from flexpipe.sim.quick import guard, sound, transport_implied
from flexpipe.sim.trace import Trace
from flexpipe.sim.unit import zero_cost

Pos = tuple[int, int]  # (rank, position)


def validate(schedule: Schedule, cost: CostModel | None = None, mem_limit: LimitLike | None = None,
             registry: KindRegistry = KINDS) -> list[Violation]:
    """Every violation of ``schedule`` (empty when it is valid). ``cost`` is used for the memory
    check (unit costs when None); ``mem_limit`` is one limit for every rank or one per rank
    (``flexpipe.cost.limits``: a number in the cost model's unit, or a ``MemLimit``)."""
    limits = None if mem_limit is None else \
        list(MemLimit.of(mem_limit).per_rank(schedule.num_ranks, cost))
    guard(schedule, sorted(schedule.kinds()))
    table = sound(schedule, registry)
    if table is None:  # the fast path could not vouch for it: look closer
        found = _structure(schedule, registry)
        if found:
            return found
    if limits is None:
        sim_cost = zero_cost(schedule, sorted(_time_keys(schedule, registry)))
    else:
        sim_cost = cost if cost is not None else _fill_times(default_cost(schedule), schedule,
                                                             registry)
    try:
        trace = simulate(schedule, sim_cost, registry,
                         columns=table.per_rank() if table is not None else None)
    except ValidationError as exc:
        return list(exc.violations)
    return (_memory(trace, limits, registry) if limits else []) + _transport(schedule, registry)


def _transport(schedule: Schedule, registry: KindRegistry) -> list[Violation]:
    """The pair-order rule on the schedule's communication ops, or on its lowering (nothing to
    do when the simulation already decided it: ``quick.transport_implied``)."""
    if transport_implied(schedule, COMM_KINDS):
        return []
    if schedule.kinds() & set(COMM_KINDS):
        return pair_violations(schedule, registry)
    return pair_violations(lower(schedule), registry, note="after lowering: ")


def check(schedule: Schedule, cost: CostModel | None = None, mem_limit: LimitLike | None = None,
          registry: KindRegistry = KINDS) -> None:
    """Raise ``ValidationError`` carrying every violation (``DeadlockError`` when the only
    problem is a cycle of waits); return None for a valid schedule."""
    found = validate(schedule, cost, mem_limit, registry)
    if found and all(v.rule == "deadlock" for v in found):
        raise DeadlockError(found)
    if found and all(v.rule == RULE for v in found):
        raise PairOrderError(found)
    if found:
        raise ValidationError(found)


# --- structure --------------------------------------------------------------------------------

def _violation(schedule: Schedule, rule: str, reason: str, rank: int, position: int | None,
               op: Op | None) -> Violation:
    """A violation with the schedule printed around (rank, position)."""
    context = around(schedule, rank, position if position is not None else -1)
    return Violation(rule, reason, rank, position, str(op) if op is not None else None, context)


def _structure(schedule: Schedule, registry: KindRegistry) -> list[Violation]:
    """Violations of the structural rules, in rule order."""
    per_op, good = _per_op(schedule, registry)
    missing, flagged = _completeness(schedule, good)
    deps = _dependencies(schedule, registry, good, flagged)
    return per_op + missing + deps


def _per_op(schedule: Schedule,
            registry: KindRegistry) -> tuple[list[Violation], dict[Op, list[Pos]]]:
    """unknown-kind, range, placement and duplicate; also where each sound op sits."""
    S, M = schedule.num_stages, schedule.microbatches
    out: list[Violation] = []
    good: dict[Op, list[Pos]] = defaultdict(list)
    for r, i, op in schedule.ops():
        reason, rule = _op_problem(op, r, schedule, registry, S, M)
        if reason:
            out.append(_violation(schedule, rule, reason, r, i, op))
            if rule != "placement":
                continue
        good[op].append((r, i))
    for op, places in good.items():
        for r, i in places[1:]:
            first = places[0]
            out.append(_violation(schedule, "duplicate", f"{op} already appears on rank "
                                  f"{first[0]} at position {first[1]}", r, i, op))
    return out, good


def _op_problem(op: Op, rank: int, schedule: Schedule, registry: KindRegistry, S: int,
                M: int) -> tuple[str, str]:
    """(reason, rule) of what is wrong with one op on its own, or ("", "")."""
    if op.kind not in registry:
        return f"unknown op kind {op.kind!r} (known: {', '.join(sorted(registry.names()))})", \
            "unknown-kind"
    if not 0 <= op.stage < S:
        return f"stage {op.stage} is outside 0..{S - 1}", "range"
    if not 0 <= op.mb < M:
        return f"micro-batch {op.mb} is outside 0..{M - 1}", "range"
    owner = schedule.placement.rank_of(op.stage)
    if owner != rank:
        return f"stage {op.stage} is placed on rank {owner}, not rank {rank}", "placement"
    return "", ""


def _completeness(schedule: Schedule,
                  good: dict[Op, list[Pos]]) -> tuple[list[Violation], set[tuple[int, int]]]:
    """F once and BW or B+W once per stage x micro-batch; also the (stage, mb) pairs flagged."""
    out: list[Violation] = []
    flagged: set[tuple[int, int]] = set()
    for s in range(schedule.num_stages):
        rank = schedule.placement.rank_of(s)
        for mb in range(schedule.microbatches):
            have = {k for k in ("F", "B", "W", "BW") if Op(k, s, mb) in good}
            for reason, kind, anchor in _missing(have):
                flagged.add((s, mb))
                at = good.get(Op(anchor, s, mb)) if anchor else None
                r, pos = at[0] if at else (rank, None)
                out.append(_violation(schedule, "completeness", reason.format(s=s, mb=mb),
                                      r, pos, Op(kind, s, mb)))
    return out, flagged


def _missing(have: set[str]) -> Iterable[tuple[str, str, str | None]]:
    """(reason template, op kind, kind of an op to point at) for each completeness problem."""
    anchor = next((k for k in ("F", "BW", "B", "W") if k in have), None)
    if "F" not in have:
        yield "stage {s} micro-batch {mb} has no forward F", "F", anchor
    if "BW" in have and have & {"B", "W"}:
        yield ("stage {s} micro-batch {mb} has both a fused BW and a split B/W backward", "BW",
               "BW")
    elif "B" in have and "W" not in have:
        yield "stage {s} micro-batch {mb} has B but no W", "W", "B"
    elif "W" in have and "B" not in have:
        yield "stage {s} micro-batch {mb} has W but no B", "B", "W"
    elif not have & {"B", "W", "BW"}:
        yield "stage {s} micro-batch {mb} has no backward (BW, or B and W)", "BW", anchor


def _dependencies(schedule: Schedule, registry: KindRegistry, good: dict[Op, list[Pos]],
                  flagged: set[tuple[int, int]]) -> list[Violation]:
    """missing-dependency and order, over the sound ops only."""
    clean = schedule.with_ranks([[op for op in ops if op in good] for ops in schedule.ranks])
    index = DepIndex(clean, registry)
    out: list[Violation] = []
    for op, places in good.items():
        r, i = places[0]
        for dep in index.needs(op):
            if not index.has(dep):
                if (dep.stage, dep.mb) not in flagged:
                    out.append(_violation(schedule, "missing-dependency",
                                          f"needs {dep}, which no rank runs", r, i, op))
                continue
            dr, di = good[dep][0]
            if dr == r and di > i:
                out.append(_violation(schedule, "order", f"needs {dep}, which comes later on "
                                      f"rank {r} (position {di})", r, i, op))
    out.sort(key=lambda v: (v.rule, v.rank or 0, v.position or 0))
    return out


# --- costs and memory -------------------------------------------------------------------------

def _time_keys(schedule: Schedule, registry: KindRegistry) -> set[str]:
    """Every cost-model time key that the schedule's op kinds read."""
    return {k for name in schedule.kinds() for k, _ in (*registry[name].time,
                                                         *registry[name].fallback)}


def _fill_times(cost: CostModel, schedule: Schedule, registry: KindRegistry) -> CostModel:
    """``cost`` with a zero time for each key the schedule's kinds read that it lacks."""
    keys = _time_keys(schedule, registry)

    def fill(st: StageCost) -> StageCost:
        extra = {k: 0.0 for k in keys if not st.has_time(k)}
        return replace(st, times={**st.times, **extra}) if extra else st

    return replace(cost, stages=tuple(fill(st) for st in cost.stages))


def _memory(trace: Trace, limits: list[float], registry: KindRegistry) -> list[Violation]:
    """One violation per rank whose peak memory exceeds its limit."""
    schedule = trace.schedule
    peaks = trace.metrics(registry).peak_memory
    out = []
    for r, (peak, limit) in enumerate(zip(peaks, limits, strict=True)):
        if peak <= limit:
            continue
        static = trace.static_memory[r]
        when = next(t for t, v in trace.memory[r] if v + static > limit)
        starts = trace.starts[r]
        pos = max((i for i, t in enumerate(starts) if t <= when), default=None)
        op = schedule.ranks[r][pos] if pos is not None else None
        during = f", first over at time {when:g} (at {op})" if op is not None else ""
        reason = (f"peak memory {peak:g} exceeds the limit {limit:g} by {peak - limit:g}"
                  f"{during}")
        out.append(_violation(schedule, "memory", reason, r, pos, op))
    return out


def count_rules(violations: Iterable[Violation]) -> dict[str, int]:
    """How many violations of each rule (handy in reports and tests)."""
    return dict(Counter(v.rule for v in violations))
