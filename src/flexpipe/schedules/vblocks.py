"""Adaptive V by building blocks: the controllable-memory paper's scheduler (Qi et al., NeurIPS
2024, section 3.1 and appendix A), written from the paper and its authors' scheduler's
behaviour.

A building block gives every rank a pattern of its six chunk passes (F, f, B, b, W, w: see
``vrows``) in a period of six slots. Rank 0's pattern puts F at slot 0 and f, B, b at three
other slots; each next rank shifts F and B by +d, f and b by -1 (mod 6), with one offset d for
the first ranks and another (not larger) for the rest; W and w take the first free slot after
their B and b. Every such block (collision-free) is repeated every six slots, squeezed,
its warm-up and cool-down laid out again, its bubbles filled (``vrows``), then timed with the
cost model; the fastest within the memory limit wins. At unit costs this reaches the paper's
adaptive curve b(M) = 3p - 1 - 3M + max(3p, p + 1 + 2 ceil(M/2)) idle slots at M chunk
activations, p <= M <= 2p (``benchmarks/anchors.py``).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import remembered
from flexpipe.schedules.vrows import (
    Rows,
    compact,
    complete,
    cool_down,
    fill_bubbles,
    peaks,
    relabel_weights,
    replay,
    warm_up,
)

PERIOD = 6
LIBRARY_MAX_P = 16
"""V-Min and V-Half try the blocks up to this p (at p = 16 their limits admit a few hundred
blocks: seconds; the count of blocks and their length grow with p and m)."""
OFFSETS = range(1, PERIOD)  # the shift d of F and B from one rank to the next
Block = tuple[tuple[int, int, int, int], ...]  # per rank: slot of F, f, B, b (mod 6)


@lru_cache(maxsize=64)
def building_blocks(p: int) -> tuple[Block, ...]:
    """Every distinct collision-free building block of the paper's family for p ranks."""
    seen: dict[Block, None] = {}
    for ff, bu, bd in permutations(range(1, PERIOD), 3):
        for d0 in OFFSETS:
            for d1 in range(1, d0 + 1):
                for first in range(1, max(p, 2)):
                    block = _shifted((0, ff, bu, bd), p, d0, d1, first)
                    if block is not None:
                        seen.setdefault(block, None)
    return tuple(seen)


def _shifted(head: tuple[int, int, int, int], p: int, d0: int, d1: int,
             first: int) -> Block | None:
    """Rank 0's pattern ``head`` shifted rank by rank (offset d0 for the ``first`` ranks, then
    d1); None when two passes or their weight passes would share a slot."""
    rows = [head]
    for i in range(p - 1):
        d = d0 if i < first else d1
        f, ff, bu, bd = rows[-1]
        rows.append(((f + d) % PERIOD, (ff - 1) % PERIOD, (bu + d) % PERIOD, (bd - 1) % PERIOD))
    for row in rows:
        if len(set(row)) < 4 or len(set(_with_weights(row))) < PERIOD:
            return None
    return tuple(rows)


def _with_weights(row: tuple[int, int, int, int]) -> tuple[int, ...]:
    """The pattern with W and w at the first free slot after B and b (B's first)."""
    used = list(row)
    for b in (row[2], row[3]):
        used.append(next((b + k) % PERIOD for k in range(PERIOD)
                         if (b + k) % PERIOD not in used))
    return tuple(used)


def repeat(block: Block, p: int, m: int) -> Rows:
    """The block repeated every six slots for m micro-batches: micro-batch 0's passes at the
    first slots of their pattern in dependency order (F down the ranks, f back up, B down, b
    back up), each after the one before."""
    place: dict[tuple[int, str], int] = {}
    t = 0
    chain = ([(i, "F", 0) for i in range(p)] + [(i, "f", 1) for i in reversed(range(p))]
             + [(i, "B", 2) for i in range(p)] + [(i, "b", 3) for i in reversed(range(p))])
    for i, tok, v in chain:
        t += (block[i][v] - t) % PERIOD
        place[(i, tok)] = t
        t += 1
    rows: Rows = []
    for i in range(p):
        full = _with_weights(block[i])
        for tok, v, of in (("W", 4, "B"), ("w", 5, "b")):
            start = place[(i, of)]
            place[(i, tok)] = start + (full[v] - start) % PERIOD
        width = max(place[(i, tok)] for tok in "FfBbWw") + PERIOD * m
        row = [" "] * width
        for tok in "FfBbWw":
            for j in range(m):
                row[place[(i, tok)] + PERIOD * j] = tok
        rows.append(row)
    return rows


def block_rows(block: Block, p: int, m: int) -> Rows | None:
    """The paper's repeat, squeeze and reorder of ``block`` for m micro-batches (m < 2p: done
    for 2p and cut back); None when a step would raise the block's peak or breaks a
    dependency."""
    full = max(m, 2 * p)
    rows = repeat(block, p, full)
    first_peak = max(peaks(rows))
    squeezed = compact(rows) if first_peak <= 2 * p else None
    warm = compact(warm_up(squeezed, full)) if squeezed else None
    if warm is None or max(peaks(warm)) > first_peak:
        return None
    if m < full:
        cut = _first(warm, m)
        warm = compact(_release_weights(cut, p) if m <= p else cut)
        if warm is None:
            return None
        first_peak = max(peaks(warm))
    cooled = cool_down(warm, m)
    if cooled is None:
        return None
    done = relabel_weights(fill_bubbles(cooled))
    if max(peaks(done)) > first_peak or not complete(done, m):
        return None
    return done


def _first(rows: Rows, m: int) -> Rows:
    """Only the first m passes of each kind of every row."""
    out = []
    for row in rows:
        seen: dict[str, int] = {}
        new = []
        for tok in row:
            seen[tok] = seen.get(tok, 0) + 1
            new.append(tok if tok == " " or seen[tok] <= m else " ")
        out.append(new)
    return out


def _release_weights(rows: Rows, p: int) -> Rows:
    """With few micro-batches, rows below the peak hold their first weight passes to the end,
    using the memory the peak allows (fewer early idle slots)."""
    have = peaks(rows)
    top = min(2 * p, max(have))
    out = []
    for row, peak in zip(rows, have, strict=True):
        row, moved = list(row), list[str]()
        for j, tok in enumerate(row):
            if peak + len(moved) >= top:
                break
            if tok in "Ww":
                moved.append(tok)
                row[j] = " "
        out.append(row + moved)
    return out


@lru_cache(maxsize=4096)
def _result(block: Block, p: int, m: int) -> tuple[int, tuple[str, ...]] | None:
    """``block_rows`` of one block, as (peak, rows as strings)."""
    rows = block_rows(block, p, m)
    return None if rows is None else (max(peaks(rows)), tuple("".join(r) for r in rows))


@lru_cache(maxsize=4096)
def _repeat_peak(block: Block, p: int) -> int:
    """The peak of the block repeated for 2p micro-batches: at most its peak repeated for any
    m >= 2p (more micro-batches only add). Like the authors' scheduler, which does not try a
    block whose repetition holds more than the limit, ``candidates`` skips a block above the
    cap here (a weaker cut than theirs: fewer micro-batches)."""
    return max(peaks(repeat(block, p, 2 * p)))


def clear_caches() -> None:
    """Forget every block's rows, repeat peak and timing (a cold start, for timing it)."""
    for cached in (_result, _repeat_peak, timed):
        cached.cache_clear()


def candidates(p: int, m: int, max_peak: int | None = None) -> list[tuple[int, tuple[str, ...]]]:
    """(peak chunk activations, rows) of every building block that survives the reordering,
    distinct rows only, for p ranks and m micro-batches, by peak; with m >= 2p only blocks
    whose repetition holds at most ``max_peak`` chunk activations (``_repeat_peak``)."""
    # m >= 2p: a block whose repetition holds more than the cap is not tried (the authors'
    # rule); with fewer micro-batches the cut lowers the peak, so every block is tried
    cap = 2 * p if max_peak is None or m < 2 * p else min(max_peak, 2 * p)
    seen: dict[tuple[str, ...], int] = {}
    for block in building_blocks(p):
        if _repeat_peak(block, p) <= cap:
            got = _result(block, p, m)
            if got is not None:
                seen.setdefault(got[1], got[0])
    return sorted((peak, rows) for rows, peak in seen.items())


STAGE_OF = {"F": False, "b": False, "w": False, "f": True, "B": True, "W": True}  # up chunk?
KIND_OF = {"F": "F", "f": "F", "B": "B", "b": "B", "W": "W", "w": "W"}


def rows_schedule(rows: tuple[str, ...], p: int, m: int, name: str = "v-blocks") -> Schedule:
    """The V placement's schedule running each row's tokens in slot order."""
    ranks: list[list[Op]] = []
    for i, row in enumerate(rows):
        seen: dict[str, int] = {}
        ops = []
        for tok in row.replace(" ", ""):
            stage = 2 * p - 1 - i if STAGE_OF[tok] else i
            ops.append(Op(KIND_OF[tok], stage, seen.get(tok, 0)))
            seen[tok] = seen.get(tok, 0) + 1
        ranks.append(ops)
    return Schedule.build(ranks, Placement.vshape(p), m, name=name)


Pass = tuple[float, float, float]  # duration, activation change, transfer of its input
Table = tuple[tuple[tuple[str, Pass], ...], ...]  # per rank: (token, its pass) pairs


def _pass_table(p: int, cost: CostModel) -> Table:
    """Per rank and token: its time, activation change and input transfer (cost model);
    hashable, so a block's timing is computed once per cost (the search's memory ladder asks
    for the same blocks at every rung)."""
    from flexpipe.dsl.block import stage_transfer

    pl = Placement.vshape(p)
    out = []
    for i in range(p):
        row = {}
        for tok, up in STAGE_OF.items():
            s = 2 * p - 1 - i if up else i
            st, kind = cost.stage(s), KIND_OF[tok]
            dmem = {"F": st.act, "B": st.wact - st.act, "W": -st.wact}[kind]
            xfer = 0.0
            if kind == "F" and s > 0:
                xfer = stage_transfer(cost, pl, s - 1, s, s - 1)
            elif kind == "B" and s < 2 * p - 1:
                xfer = stage_transfer(cost, pl, s + 1, s, s)
            row[tok] = (st.time(kind), dmem, xfer)
        out.append(tuple(sorted(row.items())))
    return tuple(out)


@lru_cache(maxsize=1 << 16)
def timed(rows: tuple[str, ...], passes: Table) -> tuple[float, float]:
    """(largest per-rank span, peak activation of a rank) of ``rows`` run in slot order with
    the times of ``passes`` (each pass at once when its rank is free and its input arrived)."""
    table = [dict(row) for row in passes]
    orders = [row.replace(" ", "") for row in rows]
    start = replay(orders, [{tok: (c[0], c[2]) for tok, c in row.items()} for row in table])
    if start is None:
        raise ConfigError("v_blocks: the rows deadlock (not a schedule)")
    span = max(max(st[-1] + table[i][tok][0] for tok, st in row.items() if st)
               - min(st[0] for st in row.values() if st)
               for i, row in enumerate(start) if orders[i])
    peak = 0.0
    for i, row in enumerate(orders):
        cur = 0.0
        for tok in row:
            cur += table[i][tok][1]
            peak = max(peak, cur)
    return span, peak


SHORTLIST = 8  # candidates simulated after the quick timing


@remembered
def v_blocks(p: int, m: int, cost: CostModel | None = None,
           mem_limit: float | None = None) -> Schedule:
    """The fastest building-block schedule (module docstring) whose peak activation per rank,
    simulated with ``cost``, is within ``mem_limit`` (default: 1F1B's, p M_B). InfeasibleError
    when none fits (below about p/2 M_B)."""
    from flexpipe.sim.engine import simulate

    if not isinstance(p, int) or p < 1 or not isinstance(m, int) or m < 1:
        raise ConfigError(f"v_blocks needs positive integers p and m, got p={p!r}, m={m!r}")
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    stages = [cost.stage(s) for s in range(2 * p)]
    limit = mem_limit if mem_limit is not None else p * 2 * max(st.act for st in stages)
    least = min(min(st.act, st.wact) for st in stages)  # a held chunk costs at least this
    cap = int(limit / least + 1e-9) if least > 0 else None
    table = _pass_table(p, cost)
    quick = []
    for peak, rows in candidates(p, m, cap):
        if cap is not None and peak > cap:
            break  # by peak: the rest hold more than the limit allows too
        span, held = timed(rows, table)
        if held <= limit + 1e-9:
            quick.append((span, rows))
    best: tuple[float, Schedule] | None = None
    for _span, rows in sorted(quick)[:SHORTLIST]:  # the simulator has the last word
        sched = rows_schedule(rows, p, m)
        met = simulate(sched, cost).metrics()
        if max(met.peak_activation) <= limit + 1e-9 and (best is None
                                                         or met.bubble_rate < best[0] - 1e-12):
            best = (met.bubble_rate, sched)
    if best is None:
        raise InfeasibleError(f"no building block of adaptive V fits {limit:g} per rank "
                              f"(p={p}, m={m})")
    return best[1]
