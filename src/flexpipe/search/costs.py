"""The search's view of a cost model: fitting one model to any placement, per-rank memory
limits, and the analytic bounds that prune candidates before they are simulated.

Convention: the user's cost model describes the model cut into ``n`` consecutive stages (usually
one per rank, as on a linear placement). A placement with ``S`` virtual stages cuts the same
model into ``S`` equal-depth chunks: when ``S`` is a multiple of ``n``, chunk k is stage
``k * n // S`` scaled by ``n / S`` (times, activation, parameters; the boundary tensor it sends
keeps its size); when ``n`` is a multiple of ``S``, each chunk is the sum of ``n / S`` consecutive
stages. So an embedding-heavy stage 0 stays heavy in whichever chunks cover it, and memory stays
in the user's units: one micro-batch on a full stage holds ``act`` = M_B.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from flexpipe.cost.model import SR_KEYS, CostModel, StageCost, merge_stages
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.overlap import COMM_SHARE
from flexpipe.ir.placement import Placement
from flexpipe.schedules.dualpipe_twoway import TWO_WAY

WORK_KEYS = ("F", "B", "W")


def _scaled(st: StageCost, k: float) -> StageCost:
    """``st`` with every time and memory quantity (not the boundary size) times ``k``."""
    sr: dict[str, Any] = {key: None if getattr(st, key) is None else getattr(st, key) * k
                          for key in SR_KEYS}
    return replace(st.map_times(lambda v: v * k), act=st.act * k, wact=st.wact * k,
                   input=st.input * k, params=st.params * k, **sr)


def fit_cost(cost: CostModel, num_stages: int) -> CostModel:
    """The cost model of ``cost``'s model cut into ``num_stages`` chunks (module docstring)."""
    n = cost.num_stages
    if num_stages == n:
        return cost
    if num_stages % n == 0:
        k = num_stages // n
        stages = tuple(_scaled(cost.stages[s // k], 1.0 / k) for s in range(num_stages))
    elif n % num_stages == 0:
        k = n // num_stages
        stages = tuple(merge_stages(cost.stages[s * k:(s + 1) * k]) for s in range(num_stages))
    else:
        raise ConfigError(f"the cost model's {n} stages cannot be cut into {num_stages} chunks "
                          f"(one count must divide the other)")
    return CostModel(stages, cost.comm)


def split_counts(counts: Sequence[int], k: int) -> list[int]:
    """Layers per stage of ``counts``' model cut k times finer, each stage's layers in k
    chunks as even as possible (the earlier ones get the extra layers): the finer partition
    whose cost model ``fit_cost`` merges back into ``counts``' stages exactly (chunk j of the
    coarse cut is the fine stages k*j .. k*j + k-1, the layers it holds and no others)."""
    if k < 1 or any(c < k for c in counts):
        raise ConfigError(f"cannot cut stages of {list(counts)} layers into {k} chunks each "
                          "(each chunk needs a layer)")
    return [c // k + (i < c % k) for c in counts for i in range(k)]


def fit_placement(cost: CostModel, placement: Placement) -> CostModel:
    """``fit_cost`` for ``placement``'s stages; DualPipe's two directions (``TWO_WAY``) are
    two copies of the cut into one stage per rank (stage p + k is stage k again)."""
    if placement.kind != TWO_WAY:
        return fit_cost(cost, placement.num_stages)
    one = fit_cost(cost, placement.num_ranks)
    return CostModel(one.stages + one.stages, one.comm)


def per_direction(placement: Placement, m: int) -> int:
    """The micro-batches each stage of ``placement`` runs when a step has m: m, or m / 2 on
    DualPipe's two directions (half fed from each end; an odd m is refused)."""
    if placement.kind != TWO_WAY:
        return m
    if m % 2:
        raise InfeasibleError(f"the two directions take half the micro-batches each: m = {m} "
                              "must be even")
    return m // 2


def rank_work(cost: CostModel, placement: Placement, m: int) -> tuple[float, ...]:
    """Per rank, the F + B + W time of all its passes (less what overlapped pairs can hide,
    ``stage_floor``): no schedule's span on that rank is shorter, so the largest is a lower
    bound on the span (and the makespan)."""
    per_mb = [stage_floor(cost.stage(s)) for s in range(cost.num_stages)]
    return tuple(m * sum(per_mb[s] for s in stages) for stages in placement.rank_stages)


def stage_floor(st: StageCost) -> float:
    """The least time one micro-batch's passes on stage ``st`` take: F + B + W, or where the
    stage gives communication parts (``F_COMM``, ``BW_COMM``, ...: ``flexpipe.ir.overlap``)
    each pass's compute alone, F's plus the smaller of a split and a fused backward's, since
    an overlapped pair hides its passes' communication behind each other's compute and lasts
    at least their two computes (``pair_time``)."""
    comm = {k: COMM_SHARE.format(k) for k in (*WORK_KEYS, "BW")}
    if not any(key in st.times for key in comm.values()):
        return sum(st.time(k) for k in WORK_KEYS)

    def net(kind: str) -> float:
        return st.time(kind) - (st.time(comm[kind]) if comm[kind] in st.times else 0.0)

    return net("F") + min(net("B") + net("W"), net("BW"))


def rank_mb_act(cost: CostModel, placement: Placement) -> tuple[float, ...]:
    """Per rank, the activation one micro-batch holds across all its chunks at once (its first
    chunk's activation is kept until its last chunk's backward): no schedule without recompute
    or offload fits under less."""
    return tuple(sum(cost.stage(s).act for s in stages) for stages in placement.rank_stages)


def span_bound(cost: CostModel, placement: Placement, m: int) -> float:
    """Lower bound on the largest per-rank span (the bubble rate's ``cost``)."""
    return max(rank_work(cost, placement, m))
