"""``GraphModel``: one model laid out on devices as a stage graph, a placement and a cost model,
plus its layers in the order a chain-only framework would run them (for the baseline).

``balanced_cut`` splits consecutive layers into k stages with the smallest largest stage time;
``chain_baseline`` is what a chain-only framework does with the same model: every layer (the
branches one after another) on a chain of p balanced stages, scheduled with 1F1B."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexpipe.cost.model import Comm, CostModel, StageCost, merge_stages
from flexpipe.cost.partition import minimax_cuts
from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

WORK = ("F", "B", "W")


@dataclass(frozen=True)
class GraphModel:
    """A model on ``placement.num_ranks`` devices. ``layout`` names how its stages are cut and
    placed; ``chain`` holds its layers (each a ``StageCost``) in chain order for the baseline."""

    name: str
    layout: str
    graph: StageGraph
    placement: Placement
    cost: CostModel
    chain: tuple[StageCost, ...]

    def __post_init__(self) -> None:
        if self.graph.num_stages != self.placement.num_stages:
            raise ConfigError(f"{self.name}[{self.layout}]: graph has {self.graph.num_stages} "
                              f"stages, placement {self.placement.num_stages}")
        self.cost.check_fits(self.placement.num_stages, self.placement.num_ranks)

    @property
    def label(self) -> str:
        """``name[layout]``."""
        return f"{self.name}[{self.layout}]"


def work(stage: StageCost) -> float:
    """F + B + W time of one micro-batch on ``stage``."""
    return sum(stage.time(k) for k in WORK)


def balanced_cut(layers: Sequence[StageCost], k: int) -> tuple[StageCost, ...]:
    """``layers`` cut into ``k`` consecutive stages minimising the largest stage's F + B + W
    (exact: ``flexpipe.cost.partition``'s dynamic programme over cut points)."""
    n = len(layers)
    if not 1 <= k <= n:
        raise ConfigError(f"cannot cut {n} layers into {k} stages")
    cuts = minimax_cuts([work(st) for st in layers], k)
    return tuple(merge_stages(layers[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))


def chain_baseline(model: GraphModel, m: int) -> tuple[Schedule, CostModel]:
    """The chain-only framework's run of ``model``: its layers in chain order cut into one
    balanced stage per device, scheduled with 1F1B; returns the schedule and its cost model."""
    from flexpipe.schedules.registry import build

    p = model.placement.num_ranks
    comm: Comm = model.cost.comm
    cost = CostModel(balanced_cut(model.chain, p), comm)
    return build("1f1b", p, m).renamed(f"chain-1f1b {model.name}"), cost
