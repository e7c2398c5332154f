"""The search space: every library family with a small grid of its parameters, plus synthesis by
the memory-aware list scheduler (``flexpipe.dsl.policy``) over linear, V-shape and interleaved
placements with a grid of its knobs. A ``Candidate`` is data (family + parameters); ``build``
turns it into a ``Schedule`` for a cost model already fitted to its placement."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from flexpipe.cost.model import CostModel
from flexpipe.dsl.cutoff import Cutoff
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import InfeasibleError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.search.costs import per_direction

Params = tuple[tuple[str, object], ...]

# Cheap, strong schedules first, so the incumbent is good early and bounds prune more.
FIRST = ("zb-h2", "zb-h1", "1f1b", "zb-v", "v-zb", "v-half", "v-min")
PLACEMENTS: dict[str, Callable[[int], Placement]] = {
    "linear": Placement.linear,
    "vshape": Placement.vshape,
    "interleaved": lambda p: Placement.interleaved(p, 2),
}


@dataclass(frozen=True)
class Candidate:
    """One point of the space: a library ``family`` (or "policy") with its parameters, the
    placement kind and the chunks per rank that its cost model is fitted to."""

    family: str
    params: Params
    placement: str
    chunks: int

    @property
    def label(self) -> str:
        """Short unique name, e.g. ``interleaved-1f1b v=3`` or ``policy[vshape] ahead=2p``."""
        text = " ".join(f"{k}={_show(v)}" for k, v in self.params)
        head = self.family if self.family != "policy" else f"policy[{self.placement}]"
        return f"{head} {text}".strip()

    def kwargs(self) -> dict[str, object]:
        """The parameters as a dict."""
        return dict(self.params)


def _show(value: object) -> str:
    return "-".join(map(str, value)) if isinstance(value, tuple) else str(value)


def placement_of(cand: Candidate, p: int) -> Placement:
    """The placement a candidate runs on."""
    from flexpipe.schedules.registry import library

    if cand.family == "policy":
        return PLACEMENTS[cand.placement](p)
    return library()[cand.family].placement_for(p, **cand.kwargs())


def library_candidates(p: int) -> list[Candidate]:
    """Every library family, with its registry entry's search grid, strong ones first.
    Overlapped families (DualPipeV, DualPipe) are among them: the simulator prices their pairs
    from the cost's communication parts (``F_COMM``, ``BW_COMM``), so they win where those are
    large and lose to the zero-bubble ones without them."""
    from flexpipe.schedules.registry import library

    lib = library()
    order = [n for n in FIRST if n in lib] + sorted(n for n in lib if n not in FIRST)
    out = []
    for name in order:
        grid = dict(lib[name].grid)
        variants: list[dict[str, object]] = [{}]
        variants += [{k: v} for k, vals in grid.items() for v in vals[1:]]
        if grid:
            key, vals = next(iter(grid.items()))
            variants[0] = {key: vals[0]}
        for kw in variants:
            chunks = lib[name].chunks(p, **kw)
            kind = "linear" if chunks == 1 else f"{chunks}-chunk"
            out.append(Candidate(name, tuple(kw.items()), kind, chunks))
    return out


def policy_candidates(p: int, m: int) -> list[Candidate]:
    """The list scheduler's knob grid: warm-up depth ``ahead`` (a x (p - r) + b on rank r, for
    linear placements; else only the memory limit), reservation mode, kind preference, split or
    fused backward; and the constructions built for the limit (``BUILDER_PLACEMENTS``):
    adaptive V's greedy (``schedules.vgreedy``), the V patterns at every gap
    (``schedules.vpattern``), the zero-bubble paper's heuristic on the linear placement
    (``schedules.zbgreedy``) and the paper's adaptive V over every building block
    (``schedules.vblocks``)."""
    out: list[Candidate] = []
    aheads = {"linear": ("none", "1p", "1.5p", "2p-1", "2p", "2p+1"),
              "vshape": ("none",), "interleaved": ("none",)}
    for kind, grid in aheads.items():
        chunks = PLACEMENTS[kind](p).num_stages // p
        # one stage per rank: nothing to reserve for later stages, "all" equals "auto"
        reserves = ("auto",) if chunks == 1 else ("auto", "all")
        for ahead in grid:
            for reserve in reserves:
                params = (("ahead", ahead), ("reserve", reserve))
                out.append(Candidate("policy", params, kind, chunks))
        for reserve in reserves:
            params = (("prefer", "FBW"), ("reserve", reserve))
            out.append(Candidate("policy", params, kind, chunks))
        out.append(Candidate("policy", (("split", False),), kind, chunks))
    for name, (kind, _, max_p) in BUILDER_PLACEMENTS.items():
        if max_p is not None and p > max_p:
            continue  # too slow beyond
        chunks = PLACEMENTS[kind](p).num_stages // p
        out.append(Candidate("policy", (("builder", name),), kind, chunks))
    return out


AHEAD: dict[str, tuple[float, float]] = {
    "1p": (1.0, 0.0), "1.5p": (1.5, 0.0), "2p-1": (2.0, -1.0), "2p": (2.0, 0.0),
    "2p+1": (2.0, 1.0),
}


def _ahead(name: str, p: int) -> Callable[[int], float] | None:
    if name == "none":
        return None
    a, b = AHEAD[name]
    return lambda r: max(1, round(a * (p - r) + b))


def build(cand: Candidate, p: int, m: int, cost: CostModel,
          limits: tuple[float, ...], cutoff: Cutoff | None = None) -> Schedule:
    """The schedule of ``cand`` for p ranks, m micro-batches and ``cost`` (fitted to it);
    ``cutoff``: a list-scheduler candidate stops with ``CutoffReached`` once it provably ends
    no better (``dsl.cutoff``)."""
    if cand.family != "policy":
        return _library(cand, p, m, cost)
    kw = cand.kwargs()
    builder = kw.get("builder")
    if builder is not None:  # a construction for the limit (``BUILDERS``)
        made = BUILDERS[str(builder)](p, m, cost, min(limits))
        return made.renamed(f"search:{cand.label}")
    prefer = tuple(str(kw.get("prefer", "BFW")))
    policy = Policy(prefer=prefer, split=bool(kw.get("split", True)), mem_limit=list(limits),
                    reserve=str(kw.get("reserve", "auto")),
                    max_ahead=_ahead(str(kw.get("ahead", "none")), p))
    return policy_schedule(PLACEMENTS[cand.placement](p), m, policy, cost,
                           name=f"search:{cand.label}", cutoff=cutoff)


def _library(cand: Candidate, p: int, m: int, cost: CostModel) -> Schedule:
    from flexpipe.schedules.registry import build as build_library
    from flexpipe.schedules.registry import library

    kw = cand.kwargs()
    if library()[cand.family].cost_aware:
        kw["cost"] = cost
    placement = library()[cand.family].placement_for(p, **kw)
    return build_library(cand.family, p, per_direction(placement, m), **kw)


def held_lower_bound(cand: Candidate, p: int, m: int) -> int | None:
    """Micro-batches rank 0 must hold at once under ``cand`` (closed form), if known."""
    from flexpipe.schedules.registry import library

    rule = library()[cand.family].held if cand.family != "policy" else None
    return rule(p, m) if rule is not None else None


def iter_space(p: int, m: int, *, library: bool = True,
               synthesis: bool = True) -> Iterator[Candidate]:
    """The whole space in evaluation order: library first, then synthesis."""
    if library:
        yield from library_candidates(p)
    if synthesis:
        yield from policy_candidates(p, m)


def _adaptive_v(p: int, m: int, cost: CostModel, limit: float) -> Schedule:
    from flexpipe.schedules.vgreedy import v_adaptive

    return v_adaptive(p, m, cost, mem_limit=limit)


def _v_blocks(p: int, m: int, cost: CostModel, limit: float) -> Schedule:
    from flexpipe.schedules.vblocks import v_blocks

    return v_blocks(p, m, cost, mem_limit=limit)


def _zb_greedy(p: int, m: int, cost: CostModel, limit: float) -> Schedule:
    from flexpipe.schedules.zbgreedy import zb_greedy

    return zb_greedy(p, m, cost, mem_limit=limit)


def _v_patterns_for(p: int, m: int, cost: CostModel, limit: float) -> Schedule:
    """The V-Min and V-Half patterns at every collision-free gap, squeezed on their slots with
    warm-up and cool-down allowed ``limit`` (in chunks of the largest stage activation): the
    fastest that fits the limit."""
    from flexpipe.schedules.vpattern import gap_variants
    from flexpipe.sim.engine import simulate

    chunk = max(cost.stage(s).act for s in range(2 * p))
    if m < 2 or chunk <= 0:
        raise InfeasibleError("the V patterns' squeeze needs m >= 2 and a stage memory")
    slots = int(limit / chunk + 1e-9)
    best: tuple[float, Schedule] | None = None
    for name in ("v-min", "v-half"):
        for sched in gap_variants(name, p, m, slots):
            met = simulate(sched, cost).metrics()
            if max(met.peak_activation) <= limit + 1e-9 and (best is None or
                                                             met.makespan < best[0] - 1e-12):
                best = (met.makespan, sched)
    if best is None:
        raise InfeasibleError(f"no V pattern fits {limit:g} per rank (p={p})")
    return best[1]


Builder = Callable[[int, int, CostModel, float], Schedule]
VBLOCKS_MAX_P = 16  # = schedules.vblocks.LIBRARY_MAX_P (checked by tests/test_search_bounds.py)
BUILDER_PLACEMENTS: dict[str, tuple[str, Builder, int | None]] = {
    "adaptive-v": ("vshape", _adaptive_v, None),  # the V family's greedy for this limit
    "v-pattern": ("vshape", _v_patterns_for, None),  # V-Min/V-Half at every gap, given the limit
    "zb-greedy": ("linear", _zb_greedy, None),  # the zero-bubble paper's heuristic for the limit
    "v-blocks": ("vshape", _v_blocks, VBLOCKS_MAX_P),  # the paper's adaptive V, every block
}
"""Constructions built for the search's memory limit: name -> (placement kind, builder, largest
p it is a candidate at; None: any). v-blocks runs wherever the library runs it
(``vblocks.LIBRARY_MAX_P``): its blocks and their rows grow with p."""
BUILDERS: dict[str, Builder] = {name: fn for name, (_, fn, _) in BUILDER_PLACEMENTS.items()}
