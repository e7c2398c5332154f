"""The controllable-memory paper's fixed V-Min and V-Half patterns as slot tables.

Time is cut into slots of one chunk pass; every micro-batch repeats the pattern 6 slots later
(six chunk passes per rank per micro-batch). On rank i (down stage i, up stage 2p-1-i):

- V-Min: F(down) at i, F(up) at 2p-1-i, B(up) at 2p+g+i, B(down) at 4p+g-1-i, with a gap g = 2
  when 3 divides p (else 0): about p/3 M_B.
- V-Half: F(down) at 2i, F(up) at 3p-i-2, B(up) at 3p+g+2i-1, B(down) at 6p+g-i-2, g = 3 when
  p is even (else 0): about p/2 M_B.

Each W takes the first free slot after its B (oldest B first). Three orders come from the table:
the plain slot order, the paper's own squeeze done on the slots (``vslots``: warm-up and
cool-down moved into free slots under the pattern's peak, which reaches the authors' bubble at
unit times), and the list scheduler run under the pattern's peak with the cost model's real
times and the slots as priority; ``pattern_schedule`` returns the best by simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from flexpipe.cost.model import CostModel
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.vslots import fill_w, squeeze_slots

PERIOD = 6
GAPS = range(8)  # gaps g tried around the paper's (collision-free ones only)
# (F down, F up, B up, B down) slot of rank i for p ranks and gap g.
Pattern = Callable[[int, int, int], tuple[int, int, int, int]]


def _v_min(p: int, i: int, g: int) -> tuple[int, int, int, int]:
    return i, 2 * p - 1 - i, 2 * p + g + i, 4 * p + g - 1 - i


def _v_half(p: int, i: int, g: int) -> tuple[int, int, int, int]:
    return 2 * i, 3 * p - i - 2, 3 * p + g + 2 * i - 1, 6 * p + g - i - 2


PATTERNS: dict[str, Pattern] = {"v-min": _v_min, "v-half": _v_half}
PAPER_GAP: dict[str, Callable[[int], int]] = {
    "v-min": lambda p: 2 if p % 3 == 0 else 0, "v-half": lambda p: 3 if p % 2 == 0 else 0}
"""The paper's gap between the forward and backward halves of each pattern."""


def slot_table(name: str, p: int, m: int, gap: int | None = None) -> dict[Op, int]:
    """The slot of every pass of pattern ``name`` for p ranks and m micro-batches (``gap``:
    the paper's by default; other gaps trade memory for bubble). InfeasibleError when two
    passes of a rank take one slot."""
    if name not in PATTERNS:
        raise ConfigError(f"unknown V pattern {name!r} (known: {', '.join(PATTERNS)})")
    g = PAPER_GAP[name](p) if gap is None else gap
    slots: dict[Op, int] = {}
    for i in range(p):
        fd, fu, bu, bd = PATTERNS[name](p, i, g)
        row: dict[int, Op] = {}
        for j in range(m):
            for kind, s, t in (("F", i, fd), ("F", 2 * p - 1 - i, fu), ("B", 2 * p - 1 - i, bu),
                               ("B", i, bd)):
                if t + PERIOD * j in row:
                    raise InfeasibleError(f"{name} pattern with gap {g}: two passes of rank "
                                          f"{i} take slot {t + PERIOD * j} (p={p})")
                row[t + PERIOD * j] = Op(kind, s, j)
        slots.update({op: t for t, op in row.items()})
        slots.update(fill_w(row))
    return slots


def _peak(slots: dict[Op, int], placement: Placement, cost: CostModel) -> float:
    """The largest activation a rank holds running its passes in slot order."""
    mem = [0.0] * placement.num_ranks
    peak = [0.0] * placement.num_ranks
    for op in sorted(slots, key=slots.__getitem__):
        st, r = cost.stage(op.stage), placement.stage_rank[op.stage]
        mem[r] += {"F": st.act, "B": st.wact - st.act, "W": -st.wact}[op.kind]
        peak[r] = max(peak[r], mem[r])
    return max(peak)


def pattern_schedule(name: str, p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """Pattern ``name`` ("v-min" or "v-half") for p ranks, m micro-batches and ``cost``: the
    fastest of the plain slot order, the slot-level squeeze and the list-scheduled squeeze,
    each under the pattern's own peak."""
    from flexpipe.sim.engine import simulate

    placement = Placement.vshape(p)
    cost = cost or CostModel.per_rank(placement.stage_rank, p)
    slots = slot_table(name, p, m)
    limit = _peak(slots, placement, cost)
    tries = [_in_slot_order(slots, placement, m, name)]
    if m >= 2:  # the squeeze's phases need a steady phase to keep
        tries.append(squeezed(name, p, m))
    for reserve in ("all", "none"):
        policy = Policy(priority=slots.__getitem__, mem_limit=limit, reserve=reserve)
        try:
            tries.append(policy_schedule(placement, m, policy, cost, name=name))
        except InfeasibleError:
            continue
    return min(tries, key=lambda s: max(simulate(s, cost).metrics().span))


def _in_slot_order(slots: dict[Op, int], placement: Placement, m: int, name: str) -> Schedule:
    """Every rank runs its passes in slot order."""
    rows: list[list[Op]] = [[] for _ in range(placement.num_ranks)]
    for op in sorted(slots, key=slots.__getitem__):
        rows[placement.stage_rank[op.stage]].append(op)
    return Schedule.build(rows, placement, m, name=name)


@lru_cache(maxsize=64)
def squeezed(name: str, p: int, m: int, limit: int | None = None,
             gap: int | None = None) -> Schedule:
    """Pattern ``name``'s slot table (``gap``: see ``slot_table``) squeezed on its slots
    (``vslots``), warm-up and cool-down allowed up to ``limit`` chunk passes in flight per rank
    (default: the pattern's peak), in slot order; m >= 2. Kept for the last 64 inputs (a pure
    function of them, asked again at every rung of a memory ladder and by every V family)."""
    placement = Placement.vshape(p)
    table = slot_table(name, p, m, gap)
    return _in_slot_order(squeeze_slots(table, p, m, limit), placement, m, name)


def gap_variants(name: str, p: int, m: int, limit: int | None = None) -> list[Schedule]:
    """Pattern ``name`` squeezed at every collision-free gap of ``GAPS`` (m >= 2): other gaps
    hold other memory, and some reach the adaptive-V curve where the paper's gap does not (V-Min
    at p = 8 with gap 4: 0.1377 at 4 M_B, unit costs, m = 3p)."""
    out = []
    for g in GAPS:
        try:
            out.append(squeezed(name, p, m, limit, g))
        except InfeasibleError:
            continue
    return out
