"""``Program``: the builder every DSL mode ends in. Declare the placement and micro-batch count,
then give each rank its order (explicit mode), or let the policy or building-block modes
compute it; ``build()`` returns an immutable ``Schedule``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from flexpipe.dsl.order import Passes, Phase
from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.kinds import KINDS
from flexpipe.ir.op import Op
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

MbOrder = Callable[[int], Iterable[int]]


class Program:
    """A schedule under construction."""

    def __init__(self, placement: Placement, microbatches: int,
                 graph: StageGraph | None = None, name: str = "") -> None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ConfigError(f"m (micro-batches) must be a positive integer, got {microbatches!r}")
        self.placement = placement
        self.m = microbatches
        self.graph = graph or StageGraph.chain(placement.num_stages)
        self.name = name
        self._orders: list[list[Op] | None] = [None] * placement.num_ranks

    @property
    def p(self) -> int:
        """Number of ranks."""
        return self.placement.num_ranks

    @property
    def ranks(self) -> range:
        """Rank indices."""
        return range(self.placement.num_ranks)

    def stages(self, rank: int) -> tuple[int, ...]:
        """Stages held by ``rank``, in increasing order."""
        return self.placement.rank_stages[rank]

    def queue(self, rank: int, kind: str, order: Sequence[tuple[int, int]] | None = None,
              stages: Sequence[int] | None = None) -> Passes:
        """The passes of ``kind`` on ``rank``: by default stage by stage (in ``stages`` order,
        default the rank's stages ascending) and micro-batch 0..m-1 within a stage; ``order``
        gives explicit (stage, micro-batch) pairs instead."""
        KINDS[kind]  # unknown kinds fail here, with the known ones listed
        if order is None:
            sts = self.stages(rank) if stages is None else stages
            order = [(s, j) for s in sts for j in range(self.m)]
        return Passes(Op(kind, s, j) for s, j in order)

    def order(self, rank: int, *phases: Phase) -> None:
        """Set ``rank``'s order to the concatenation of ``phases``."""
        if not 0 <= rank < self.p:
            raise ConfigError(f"rank {rank} is outside 0..{self.p - 1}")
        ops: list[Op] = []
        for phase in phases:
            ops += list(phase)
        self._orders[rank] = ops

    def build(self) -> Schedule:
        """The finished schedule; every rank must have been given an order."""
        missing = [r for r, o in enumerate(self._orders) if o is None]
        if missing:
            raise ConfigError(f"no order given for rank(s) {missing}")
        ranks = [o or [] for o in self._orders]
        return Schedule.build(ranks, self.placement, self.m, self.graph, self.name)
