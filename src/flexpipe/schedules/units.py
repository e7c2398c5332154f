"""Memory units shared by the library: limits such as "1F1B's memory" are p times one
micro-batch's activation on a rank, whatever unit the cost model uses (M_B, or bytes when
profiled)."""

from __future__ import annotations

from flexpipe.cost.model import CostModel
from flexpipe.ir.placement import Placement


def micro_batch_activation(placement: Placement, cost: CostModel, rank: int = 0) -> float:
    """Activation one micro-batch holds on ``rank`` across all its stages (M_B of that rank)."""
    return sum(cost.stage(s).act for s in placement.rank_stages[rank])


def one_f_one_b_memory(placement: Placement, cost: CostModel) -> float:
    """1F1B's peak activation: p micro-batches of the largest per-rank activation."""
    return placement.num_ranks * max(micro_batch_activation(placement, cost, r)
                                     for r in range(placement.num_ranks))
