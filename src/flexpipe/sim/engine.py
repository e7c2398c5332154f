"""Deterministic event simulation of a schedule under a cost model.

Each rank issues its ops in order; an op starts when (1) the previous compute op of the rank has
started (ops on other streams -- copies, communication -- are issued without blocking), (2) its
stream on that rank is free (compute, send, recv, ... run side by side) and (3) every op it needs
has ended, plus the transfer time when that op ran on another rank. Transfers on one directed
link (rank a to rank b) serialize: when an op ends, each transfer of its output to another rank
holds the link a->b for ``bytes / bandwidth`` from the later of that end and the link's previous
transfer, and arrives ``latency`` after leaving it; a link carries transfers in the order the
sender's ops end here, which is the sender's op order. a->b and b->a are independent, an output
goes once to each rank that consumes it, and with infinite bandwidth a transfer is the pure
delay ``latency`` (a hand-over on the same rank is free). A link's posting cost (``Comm.post``)
holds the compute stream before an op whose input a receive brings and after one whose output
leaves (``flexpipe.sim.compile``). No priority queue is
needed: a worklist wakes a rank when the op it waits for ends. A schedule whose ranks wait on each
other in a cycle raises ``DeadlockError`` naming the cycle; it never hangs.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe.cost.model import CostModel
from flexpipe.errors import ValidationError, Violation
from flexpipe.ir.deps import DepIndex
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.compile import Columns, Compiled, compile_schedule
from flexpipe.sim.memory import memory_curves
from flexpipe.sim.trace import Trace
from flexpipe.sim.unit import unit_cost
from flexpipe.sim.waits import deadlock_error


def default_cost(schedule: Schedule) -> CostModel:
    """Unit costs: each rank's F, B, W take 1 and hold 1 unit of memory, split over its stages
    (``CostModel.per_rank``'s values, with links stored once: ``flexpipe.sim.unit``)."""
    return unit_cost(schedule)


def simulate(schedule: Schedule, cost: CostModel | None = None,
             registry: KindRegistry = KINDS, *,
             columns: Sequence[Columns] | None = None,
             durations: Sequence[Sequence[float | None]] | None = None) -> Trace:
    """Simulate ``schedule``; see the module docstring for the rules. ``columns``: each rank's
    ops as integer arrays when the caller has them (``flexpipe.sim.quick.Table.per_rank``).
    ``durations[r][i]``: the duration of ``schedule.ranks[r][i]`` in place of the cost model's
    (None keeps it; ``flexpipe.sim.replay`` passes a measured step's)."""
    cost = cost or default_cost(schedule)
    cost.check_fits(schedule.num_stages, schedule.num_ranks)
    comp = compile_schedule(schedule, cost, registry, columns)
    if durations is not None:
        _override(comp, schedule, durations)
    starts, ends, ptr = _run(comp)
    if any(ptr[r] < len(comp.ids[r]) for r in range(len(comp.ids))):
        raise _stuck(schedule, registry, ptr)
    st, en = tuple(starts), tuple(ends)
    def memory() -> tuple:  # type: ignore[type-arg]
        return memory_curves(schedule, st, en, cost, registry, comp.keys, comp.kinds)

    return Trace(schedule, st, en, memory)


def _override(comp: Compiled, schedule: Schedule,
              durations: Sequence[Sequence[float | None]]) -> None:
    """Put the given per-op durations into ``comp``; a ``ValidationError`` names a rank whose
    list does not match its ops or a duration that is not a finite non-negative number."""
    if len(durations) != schedule.num_ranks:
        raise ValidationError([Violation("durations", f"{len(durations)} lists of durations "
                                         f"for {schedule.num_ranks} ranks")])
    problems = []
    for r, (ops, given) in enumerate(zip(schedule.ranks, durations, strict=True)):
        if len(given) != len(ops):
            problems.append(Violation("durations", f"{len(given)} durations for {len(ops)} ops",
                                      r, None, None))
            continue
        row = comp.durations[r]
        for i, d in enumerate(given):
            if d is None:
                continue
            if isinstance(d, bool) or not (isinstance(d, int | float) and 0.0 <= d < float("inf")):
                problems.append(Violation("durations", f"duration {d!r} is not a finite "
                                          "non-negative number", r, i, str(ops[i])))
            else:
                row[i] = float(d)
    if problems:
        raise ValidationError(problems)


def _run(comp: Compiled) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]], list[int]]:
    """The worklist loop: per rank start and end times, and how far each rank got."""
    n = len(comp.ids)
    size = comp.size
    end: list[float | None] = [None] * (size + 1 + comp.slots)
    begin: list[float] = [0.0] * (size + 1)
    waiting: list[list[int] | None] = [None] * (size + 1 + comp.slots)
    ptr, issue = [0] * n, [0.0] * n
    sends, link_free, hosts = comp.sends, [0.0] * comp.links, comp.host
    free = [[0.0] * len(comp.stream_names) for _ in range(n)]
    work = list(range(n - 1, -1, -1))
    while work:
        r = work.pop()
        ids, durs, strs = comp.ids[r], comp.durations[r], comp.streams[r]
        deps, offs = comp.deps[r], comp.offsets[r]
        out = sends[r] if sends is not None else None
        host = hosts[r] if hosts is not None else None
        i, t_issue, sfree = ptr[r], issue[r], free[r]
        count = len(ids)
        starts_pair = comp.pairs[r] if comp.pairs is not None else ()
        while i < count:
            if i in starts_pair:  # an overlapped pair: both start together, both end together
                at = _pair(comp, r, i, t_issue, sfree, (end, begin, waiting), link_free, work)
                if at is None:
                    break
                t_issue, i = at, i + 2
                continue
            off = offs[i]
            ready = t_issue
            for base, comm in deps[i]:
                t = end[base + off]
                if t is None:
                    w = waiting[base + off]
                    if w is None:
                        waiting[base + off] = [r]
                    else:
                        w.append(r)
                    break
                t += comm
                if t > ready:
                    ready = t
            else:
                s = strs[i]
                if sfree[s] > ready:
                    ready = sfree[s]
                dur = durs[i]
                if host is not None:  # posts on the compute thread: receives, then sends
                    pre, after = host[i]
                    if pre and sfree[0] + pre > ready:
                        ready = sfree[0] + pre
                    dur += after
                ident = ids[i]
                sfree[s] = end[ident] = done = ready + dur
                begin[ident] = ready
                if s == 0:  # compute ops hold the issue order; copies and comms are async
                    t_issue = ready
                woken = waiting[ident]
                if woken is not None:
                    work.extend(woken)
                if out is not None:
                    for slot, link, busy, lat in out[i]:  # messages queue on their links
                        t = link_free[link]
                        link_free[link] = t = (t if t > done else done) + busy
                        end[slot] = t + lat
                        woken = waiting[slot]
                        if woken is not None:
                            work.extend(woken)
                i += 1
                continue
            break
        ptr[r], issue[r] = i, t_issue
    starts = [tuple(map(begin.__getitem__, ids)) for ids in comp.ids]
    ends = [tuple(map(end.__getitem__, ids)) for ids in comp.ids]
    return starts, ends, ptr  # type: ignore[return-value]


def _pair(comp: Compiled, r: int, i: int, t_issue: float, free: list[float],
          state: tuple[list[float | None], list[float], list[list[int] | None]],
          link_free: list[float], work: list[int]) -> float | None:
    """Issue the overlapped pair at positions i and i + 1 of rank r on the compute stream: it
    starts once both ops' needs have ended (and the stream is free) and both end after the
    slot's time (``Compiled.pairs``). Returns the start, or None when it must wait (rank r
    then waits on the first need that has not ended)."""
    end, begin, waiting = state
    ready = t_issue
    for k in (i, i + 1):
        off = comp.offsets[r][k]
        for base, delay in comp.deps[r][k]:
            t = end[base + off]
            if t is None:
                w = waiting[base + off]
                waiting[base + off] = [r] if w is None else w + [r]
                return None
            ready = max(ready, t + delay)
    host = comp.host[r] if comp.host is not None else None
    pre = sum(host[k][0] for k in (i, i + 1)) if host is not None else 0.0
    after = sum(host[k][1] for k in (i, i + 1)) if host is not None else 0.0
    ready = max(ready, free[0] + pre)
    done = ready + comp.durations[r][i] + after
    free[0] = done
    for k in (i, i + 1):
        ident = comp.ids[r][k]
        begin[ident], end[ident] = ready, done
        work.extend(waiting[ident] or ())
        for slot, link, busy, lat in (comp.sends[r][k] if comp.sends is not None else ()):
            t = max(link_free[link], done) + busy
            link_free[link] = t
            end[slot] = t + lat
            work.extend(waiting[slot] or ())
    return ready


def _stuck(schedule: Schedule, registry: KindRegistry, ptr: list[int]) -> ValidationError:
    """The error for ranks that could not finish: a missing op, or a cycle of waits."""
    index = DepIndex(schedule, registry)
    missing = []
    for r, ops in enumerate(schedule.ranks):
        if ptr[r] >= len(ops):
            continue
        op = ops[ptr[r]]
        for d in index.needs(op):
            if not index.has(d):
                missing.append(Violation("missing-dependency",
                                         f"needs {d}, which no rank runs", r, ptr[r], str(op)))
    if missing:
        return ValidationError(missing)
    return deadlock_error(schedule, index, ptr)
