"""The controllable-memory V-shape family (Qi et al., NeurIPS 2024) in the building-block DSL.

Placement: V (rank i holds stages i and 2p-1-i). One micro-batch's passes are laid out as a
building block with interval T = the rank's work per micro-batch; lifespans set the memory
(peak <= sum ceil(l_s/T) m_s). Delaying each W after its B stretches lifespans: more memory,
and, once the repetition is squeezed, fewer bubbles.
"""

from __future__ import annotations

import math

from flexpipe.cost.model import CostModel
from flexpipe.dsl.block import EPS, Block, greedy_block, stage_transfer
from flexpipe.dsl.block_exact import exact_block
from flexpipe.dsl.squeeze import squeeze
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.memo import remembered
from flexpipe.schedules.units import micro_batch_activation, one_f_one_b_memory

EXACT_MAX_P = 16  # the exact block packer's size limit (its model grows with 6p passes)


def v_block(p: int, cost: CostModel | None = None, *, w_delay: float = 0.0,
            b_gap: float = 0.0, max_shift: float | None = None) -> tuple[Block, CostModel]:
    """The V-shape building block; gaps are in units of stage 0's W (B) time. The interval is
    the rank's work per micro-batch, stretched in 2.5% steps (up to 3x) when the passes cannot
    be packed into it without overlap (uneven times fragment the interval)."""
    if not isinstance(p, int) or p < 1:
        raise ConfigError(f"p must be a positive integer, got {p!r}")
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    st, work = cost.stage(0), _rank_work(p, cost)
    for k in range(81):
        try:
            block = greedy_block(placement, cost, work * (1 + k / 40), max_shift=max_shift,
                                 w_delay=w_delay * st.time("W"), b_gap=b_gap * st.time("B"))
            return block, cost
        except InfeasibleError:
            continue
    raise InfeasibleError(f"no V-shape building block fits within 3x the work per micro-batch "
                          f"(p={p}, w_delay={w_delay}, b_gap={b_gap})")


@remembered
def v_min(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """V-Min: about 1/3 of 1F1B's activation memory ((p+4)//3 M_B) and about 2/3 of its
    bubble. Candidates, the best for this p, m and cost by simulation among those within
    (p+4)//3 M_B: the tightest block (every F and B within one short pass of the moment its
    input is ready, W right behind) repeated as is -- when T_F, T_B, T_W differ it only fits
    a longer interval T, so a bubble repeats every micro-batch; the paper's fixed V-Min pattern
    squeezed with the real times (``vpattern``); and adaptive V at that limit when it is at
    least p/2 M_B: the greedy (``vgreedy``) and, for m >= 2p, the paper's own scheduler over
    every building block (``vblocks``: 0.2993 with the 1.5B times at p = 8, the authors')."""
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    times = [cost.stage(s).time(k) for s in range(2 * p) for k in ("F", "B", "W")]
    shortest = min((t for t in times if t > 0), default=1.0)  # passes of no time never collide
    unit_w = cost.stage(0).time("W")
    delay = shortest / unit_w if unit_w > 0 else 0.0  # W takes no time: nothing to delay
    limit = v_family_limit("v-min", p, cost)
    tries = _family_tries("v-min", p, m, cost, limit)
    try:
        block, cost = v_block(p, cost, w_delay=delay, max_shift=shortest)
        tight = block.schedule(m, name="v-min")
        limit = max(limit, _peak(tight, cost))  # its own bound when above (p+4)//3 M_B
        tries.insert(0, tight)
    except InfeasibleError:
        pass  # uneven times: no tight block within 3x the work; the pattern stands in
    return _best("v-min", tries, cost, limit)


def v_family_limit(name: str, p: int, cost: CostModel) -> float:
    """The activation limit per rank of V-Min ((p+4)//3 M_B), V-Half ((p+2)//2 M_B) or V-ZB
    (p M_B), M_B = one micro-batch's activation on the busiest rank."""
    per_mb = max(micro_batch_activation(Placement.vshape(p), cost, r) for r in range(p))
    return {"v-min": (p + 4) // 3, "v-half": (p + 2) // 2, "v-zb": p}[name] * per_mb


def _peak(schedule: Schedule, cost: CostModel) -> float:
    from flexpipe.sim.engine import simulate

    return max(simulate(schedule, cost).metrics().peak_activation)


def _family_tries(name: str, p: int, m: int, cost: CostModel, limit: float) -> list[Schedule]:
    """The paper's fixed pattern (V-Min, V-Half), its squeezed variants at other gaps, the
    paper's adaptive V over every building block within ``limit`` (V-Min, V-Half with m >= 2p,
    the scheduler's domain, and p <= ``vblocks.LIBRARY_MAX_P``), and adaptive V's greedy under
    ``limit``, where they exist."""
    from flexpipe.schedules.vblocks import LIBRARY_MAX_P, v_blocks
    from flexpipe.schedules.vgreedy import v_adaptive
    from flexpipe.schedules.vpattern import PATTERNS, gap_variants, pattern_schedule

    tries = [pattern_schedule(name, p, m, cost)] if name in PATTERNS else []
    if name in PATTERNS and m >= 2:
        tries += [s.renamed(name) for s in gap_variants(name, p, m)]  # within the limit: _best
    blocks = name in PATTERNS and m >= 2 * p and p <= LIBRARY_MAX_P
    builders = [v_adaptive] + ([v_blocks] if blocks else [])
    for builder in builders:
        try:
            tries.append(builder(p, m, cost, mem_limit=limit).renamed(name))
        except InfeasibleError:
            pass  # below about p/2 M_B adaptive V does not exist
    return tries


def _best(name: str, tries: list[Schedule], cost: CostModel, limit: float) -> Schedule:
    """The try with the smallest bubble rate among those within ``limit`` (the first on ties;
    the first try when none fits)."""
    from flexpipe.sim.engine import simulate

    scored = []
    for k, sched in enumerate(tries):
        met = simulate(sched, cost).metrics()
        fits = max(met.peak_activation) <= limit + 1e-9
        scored.append((not fits, round(met.bubble_rate, 12), k, sched))
    return min(scored, key=lambda x: x[:3])[3].renamed(name)


def _rank_work(p: int, cost: CostModel) -> float:
    """The largest per-micro-batch work of a rank (its two stages' F, B and W)."""
    return max(sum(cost.stage(s).time(k) for s in (i, 2 * p - 1 - i) for k in ("F", "B", "W"))
               for i in range(p))


@remembered
def v_half(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """V-Half: each W held several passes after its B, the repetition squeezed under half of
    1F1B's activation memory ((p+2)//2 M_B). About half of 1F1B's bubble; no steady-phase bubble
    when T_W + 2T_B >= 2T_F and T_W + 2T_F >= 2T_B. Candidates: the greedy block with a W delay
    of 3 or 12 W passes, squeezed; and, when uneven pass times keep the greedy packer from
    tiling T with the work (p <= 16), the exact CP-SAT block under the same bound, repeated
    as is (its steady phase has no idle time); the paper's fixed V-Half pattern squeezed with
    the real times; adaptive V at the limit (greedy, and building blocks for m >= 2p); and
    V-Min (which fits the limit, so V-Half is never worse than V-Min). The best within the
    limit for this p, m and cost, by simulation."""
    cost = cost or CostModel.per_rank(Placement.vshape(p).stage_rank, p)
    limit = v_family_limit("v-half", p, cost)
    tries = []
    for delay in (3.0, 12.0):
        block, cost = v_block(p, cost, w_delay=delay)
        tries.append(squeeze(block, m, cost, mem_limit=limit, name="v-half"))
    if block.interval > _rank_work(p, cost) + 1e-9 and p <= EXACT_MAX_P:
        exact = exact_block(block.placement, cost, limit)
        if exact is not None:
            tries.append(exact.schedule(m, name="v-half"))
    tries += _family_tries("v-half", p, m, cost, limit)
    tries.append(v_min(p, m, cost))  # V-Min fits V-Half's memory: V-Half is never worse
    return _best("v-half", tries, cost, limit)


ZB_SLOTS = (("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))  # (kind, chunk)


def v_zb_block(p: int, cost: CostModel | None = None) -> tuple[Block, CostModel]:
    """The V-ZB building block, ZB-V's steady state: every rank repeats, every T (the largest
    rank work per micro-batch), the slots F, B, W of its down chunk then F, B, W of its up
    chunk, back to back. One micro-batch's passes go in dependency order (F down the stages,
    then B back up), each into the first slot of its kind on its rank that starts once its input
    is ready; W takes the slot right after its B. A rank's slots are laid out (its phase fixed)
    by its first pass, a down-chunk F placed as soon as it is ready. In the steady phase a rank
    idles only T minus its own work; a pass waits less than T for its slot."""
    if not isinstance(p, int) or p < 1:
        raise ConfigError(f"p must be a positive integer, got {p!r}")
    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    T = _rank_work(p, cost)
    if not T > 0:
        raise ConfigError("V-ZB building block: the passes take no time (interval T = 0)")
    slot: dict[tuple[str, int], float] = {}
    for i in range(p):
        t = 0.0
        for kind, chunk in ZB_SLOTS:
            s = i if chunk == 0 else 2 * p - 1 - i
            slot[(kind, s)], t = t, t + cost.stage(s).time(kind)
    phase: dict[int, float] = {}
    offsets: dict[Op, float] = {}
    ends: dict[Op, float] = {}

    def place(kind: str, s: int, ready: float) -> None:
        a = phase.setdefault(placement.stage_rank[s], ready - slot[(kind, s)]) + slot[(kind, s)]
        op = Op(kind, s, 0)
        offsets[op] = a + max(0, math.ceil((ready - a) / T - EPS)) * T
        ends[op] = offsets[op] + cost.stage(s).time(kind)

    def arrival(kind: str, src: int, dst: int) -> float:
        """When pass (kind, src)'s output (F) or input gradient (B) is on stage dst's rank."""
        producer = src if kind == "F" else dst
        return ends[Op(kind, src, 0)] + stage_transfer(cost, placement, src, dst, producer)

    for s in range(2 * p):
        place("F", s, arrival("F", s - 1, s) if s > 0 else 0.0)
    for s in reversed(range(2 * p)):
        grad = arrival("B", s + 1, s) if s < 2 * p - 1 else 0.0
        place("B", s, max(ends[Op("F", s, 0)], grad))
        place("W", s, ends[Op("B", s, 0)])
    durations = {op: cost.stage(op.stage).time(op.kind) for op in offsets}
    return Block(placement, offsets, durations, T), cost


@remembered
def v_zb(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """V-ZB: near-zero bubble at 1F1B's activation memory (p M_B). Candidates, the best for this
    p, m and cost by simulation: ZB-V's steady state as a building block (``v_zb_block``),
    squeezed under p M_B with the cool-down's W passes filling idle time (exactly zero bubble
    at unit costs for m >= 2p, p = 2..16 tested); the greedy block with W held about 12
    passes after its B, squeezed under the same limit; and adaptive V at p M_B (``vgreedy``,
    cost-aware: it times every pass with the cost model)."""
    zb, cost = v_zb_block(p, cost)
    limit = one_f_one_b_memory(zb.placement, cost)
    tries = [squeeze(zb, m, cost, mem_limit=limit, name="v-zb", tail_w_fills=True,
                     reserve="auto")]
    block, cost = v_block(p, cost, w_delay=12.0, b_gap=1.0)
    tries.append(squeeze(block, m, cost, mem_limit=limit, name="v-zb"))
    tries += _family_tries("v-zb", p, m, cost, limit)
    return _best("v-zb", tries, cost, limit)
