"""Bounds and dominance rules that let the search skip candidates that cannot win, before
building them (docs/search.md, "Pruning").

**Warm-up bound** (``fill_bound``, a proof). On a chain, rank r's first pass is a forward of its
lowest stage ``lo`` (every other pass of the rank needs one), say at t0. Its first backward
(B or BW of any stage s of the rank) needs the forwards of stages lo .. S-1 and the backwards
of S-1 .. s+1, one after the other, plus each transfer between ranks: not before
t0 + RT_r, RT_r = sum T_F(lo..S-1) + sum T_B(hi+1..S-1) + transfers (hi: the rank's highest
stage, the shortest way back). Until then the rank runs forwards only, and nothing frees
activation memory (no weight gradient before its backward, and no recompute or offload: the
rule applies only to schedules without such kinds), so the forwards it starts fit its limit L_r:
their time is at most L_r x max_s T_F(s) / act(s). The rest of RT_r is idle inside the rank's
span, so span_r >= work_r + max(0, RT_r - L_r max_s T_F(s)/act(s)). The bound is the largest
over ranks; it is at least the rank-work bound. At 1F1B's memory on the linear placement it
is (p - 1)(T_B + 2 T_comm) above the work: the linear candidates lose to ZB-V unbuilt.

**Low-memory families** (``dominated``, measured evidence). V-Min and V-Half (the library's
``v-min``/``v-half`` and the ``v-pattern`` builder, which lays out their patterns at every gap)
are built for about p/3 and p/2 M_B and keep that memory whatever the limit; the building-block
scheduler (``v-blocks``) holds at most 2p chunk activations (p M_B), so at any limit from p M_B
up it builds what it builds at p M_B. At limits of 1F1B's memory (p M_B) and above they are
skipped: in every cell of benchmarks/search.py, the anchors (frontier at p = 4, 6, 8) and the
p = 10/12 cells they never won there, ZB-V did (``benchmarks/search.py --dominance`` runs the
full space beside the pruned one and prints both bests). Below p M_B they are searched.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from flexpipe.cost.model import CostModel
from flexpipe.errors import FlexPipeError
from flexpipe.ir.kinds import KINDS, OpKind
from flexpipe.ir.placement import Placement
from flexpipe.search.costs import rank_mb_act, rank_work
from flexpipe.search.recompute_plans import Plan, held, rank_options, recompute_time
from flexpipe.search.space import Candidate

LOW_MEMORY = ("v-min", "v-half")  # library families built for about p/3 and p/2 M_B
LOW_MEMORY_BUILDERS = ("v-pattern", "v-blocks")  # their patterns; the paper's adaptive V


def fill_bound(cost: CostModel, placement: Placement, m: int,
               limits: Sequence[float]) -> float:
    """The warm-up lower bound on the largest per-rank span (module docstring); the rank-work
    bound where the placement is not a chain's stage order."""
    out = list(rank_work(cost, placement, m))
    for r, trip in enumerate(warmup_trips(cost, placement)):
        stages = placement.rank_stages[r]
        if not stages:
            continue
        rate = max((cost.stage(s).time("F") / cost.stage(s).act for s in stages
                    if cost.stage(s).act > 0), default=float("inf"))
        out[r] += max(0.0, trip - limits[r] * rate)
    return max(out)


def warmup_trips(cost: CostModel, placement: Placement) -> list[float]:
    """Per rank, RT_r (module docstring): the least time from its first forward to its first
    backward; 0 on a rank that holds no stage."""
    S = placement.num_stages
    f = [cost.stage(s).time("F") for s in range(S)]
    b = [cost.stage(s).time("B") for s in range(S)]
    fwd = [_hop(cost, placement, s, s + 1) for s in range(S - 1)]
    back = [_hop(cost, placement, s + 1, s) for s in range(S - 1)]
    out = []
    for stages in placement.rank_stages:
        if not stages:
            out.append(0.0)
            continue
        lo, hi = min(stages), max(stages)
        out.append(sum(f[lo:]) + sum(b[hi + 1:]) + sum(fwd[lo:]) + sum(back[hi:]))
    return out


def _hop(cost: CostModel, placement: Placement, src: int, dst: int) -> float:
    """Transfer time from stage ``src``'s rank to neighbouring stage ``dst``'s of the tensor on
    their edge (the forward output of the lower one, or its gradient)."""
    a, b = placement.stage_rank[src], placement.stage_rank[dst]
    return 0.0 if a == b else cost.comm.time(a, b, cost.hop(src, dst, src < dst))


def frees_early(kind: OpKind) -> bool:
    """Whether an op of ``kind`` may free activation memory before any backward (recompute,
    offload); the backward kinds themselves (which need a consumer's backward) do not count."""
    backward = any(n.where == "succ" for n in kind.needs)
    return not backward and any(e.qty in ("act", "sr") and e.coeff < 0
                               for e in kind.memory)


@cache
def forward_only_warmup(family: str, params: tuple[tuple[str, object], ...]) -> bool:
    """Whether a library family (with ``params``) emits only kinds the warm-up bound covers:
    read off a small instance (p = 2, m = 4); False when that cannot be built, when it pairs
    passes (a pair's passes may hide the communication the warm-up trip counts) and when its
    stages are not one chain (DualPipe's two directions)."""
    from flexpipe.schedules.registry import build

    try:
        sched = build(family, 2, 4, **dict(params))
    except FlexPipeError:
        return False
    if sched.overlaps or not sched.graph.chain_edges:
        return False
    return not any(k not in KINDS or frees_early(KINDS[k]) for k in sched.kinds())


def warmup_applies(cand: Candidate) -> bool:
    """Whether ``fill_bound`` is a bound on ``cand``'s span: list-scheduler and builder
    candidates (forwards, backwards and weight gradients only) and library families whose
    kinds free no activation before a backward; only on chains (every placement here is)."""
    if cand.family == "policy":
        return True
    return forward_only_warmup(cand.family, cand.params)


def dominated(cand: Candidate, limits: Sequence[float], cost: CostModel,
              placement: Placement) -> bool:
    """Whether ``cand`` is a low-memory V family (or v-blocks) at a limit of 1F1B's memory or
    more on every rank (module docstring)."""
    low = cand.family in LOW_MEMORY or (
        cand.family == "policy" and dict(cand.params).get("builder") in LOW_MEMORY_BUILDERS)
    if not low:
        return False
    per_mb = rank_mb_act(cost, placement)
    p = placement.num_ranks
    return all(limit >= p * mb - 1e-9 for limit, mb in zip(limits, per_mb, strict=True))


def recompute_bound(cand: Candidate, cost: CostModel, placement: Placement, runs: int,
                    limits: Sequence[float]) -> float:
    """A lower bound on the span of any recompute variant of ``cand`` (``search.recompute``):
    each rank's work plus, for the cheapest of its options, the option's priced time and,
    where the warm-up bound applies, the idle time before its first backward that its
    forwards, holding what the option leaves them, and one recompute pass cannot fill."""
    work = rank_work(cost, placement, runs)
    if not warmup_applies(cand):
        return max(work)
    out = []
    for r, trip in enumerate(warmup_trips(cost, placement)):
        stages = placement.rank_stages[r]
        best = float("inf")
        for opt in rank_options(cost, stages, runs):
            best = min(best, opt.extra + _idle(cost, stages, opt.plan, trip, limits[r]))
        out.append(work[r] + (best if stages else 0.0))
    return max(out)


def _idle(cost: CostModel, stages: Sequence[int], plan: Plan, trip: float,
          limit: float) -> float:
    """The idle time before a rank's first backward that forwards holding what ``plan``
    leaves them (the least of a split and a fused backward's) and one recompute pass cannot
    fill."""
    kinds = dict(plan)
    rate = 0.0
    for s in stages:
        st = cost.stage(s)
        keep = min(held(st, kinds.get(s), True), held(st, kinds.get(s), False))
        if st.time("F") > 0:
            rate = max(rate, st.time("F") / keep if keep > 0 else float("inf"))
    one = max((recompute_time(cost.stage(s), k) for s, k in plan), default=0.0)
    return max(0.0, trip - limit * rate - one) if rate < float("inf") else 0.0
