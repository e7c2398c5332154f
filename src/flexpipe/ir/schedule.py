"""``Schedule``: per-rank ordered ops plus the placement, the stage graph and the micro-batch
count. Immutable and hashable; prints to and parses from text (``flexpipe.ir.text``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter

from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.op import Op
from flexpipe.ir.overlap import Pair, check_pairs
from flexpipe.ir.placement import Placement


@dataclass(frozen=True)
class Schedule:
    """``ranks[r]`` is the order in which rank r runs its ops; ``overlaps`` the pairs of ops
    that run in one slot (``flexpipe.ir.overlap``)."""

    ranks: tuple[tuple[Op, ...], ...]
    placement: Placement
    microbatches: int
    graph: StageGraph = field(default=None)  # type: ignore[assignment]
    name: str = ""
    overlaps: frozenset[Pair] = frozenset()

    def __post_init__(self) -> None:
        if self.graph is None:
            object.__setattr__(self, "graph", StageGraph.chain(self.placement.num_stages))
        if self.graph.num_stages != self.placement.num_stages:
            raise ConfigError(
                f"stage graph has {self.graph.num_stages} stages, placement has "
                f"{self.placement.num_stages}")
        for gang in self.graph.gangs:
            ranks = [self.placement.stage_rank[s] for s in gang]
            if len(set(ranks)) != len(ranks):
                raise ConfigError(f"gang {','.join(map(str, gang))} has two stages on one rank "
                                  f"(ranks {' '.join(map(str, ranks))}); a gang spans devices")
        if len(self.ranks) != self.placement.num_ranks:
            raise ConfigError(
                f"schedule lists {len(self.ranks)} ranks, placement has {self.placement.num_ranks}")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ConfigError(f"microbatches must be a positive integer, got {self.microbatches!r}")
        if self.overlaps:
            check_pairs(self.ranks, self.overlaps)

    @staticmethod
    def build(ranks: Sequence[Iterable[Op]], placement: Placement, microbatches: int,
              graph: StageGraph | None = None, name: str = "") -> Schedule:
        """Build from any sequences of ops (converted to tuples)."""
        ops = tuple(tuple(Op(*o) for o in rank) for rank in ranks)
        return Schedule(ops, placement, microbatches, graph, name)  # type: ignore[arg-type]

    @property
    def num_ranks(self) -> int:
        """Number of ranks (devices)."""
        return self.placement.num_ranks

    @property
    def num_stages(self) -> int:
        """Number of global virtual stages."""
        return self.placement.num_stages

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """Every (rank, position, op) in rank order."""
        for r, rank_ops in enumerate(self.ranks):
            for i, op in enumerate(rank_ops):
                yield r, i, op

    def __len__(self) -> int:
        return sum(len(r) for r in self.ranks)

    def kinds(self) -> set[str]:
        """Op kind names used anywhere in the schedule."""
        return set().union(*(map(itemgetter(0), rank) for rank in self.ranks))

    def with_ranks(self, ranks: Sequence[Iterable[Op]]) -> Schedule:
        """A copy with other per-rank op lists (same placement, graph and counts). An
        overlapped pair whose two ops are both still there is kept (and must still be listed
        together); one that lost an op (e.g. the forwards of a step kept alone) is dropped."""
        new = tuple(tuple(r) for r in ranks)
        if not self.overlaps:
            return replace(self, ranks=new)
        present = {op for ops in new for op in ops}
        kept = frozenset(p for p in self.overlaps if p[0] in present and p[1] in present)
        return replace(self, ranks=new, overlaps=kept)

    def with_overlaps(self, pairs: Iterable[Pair]) -> Schedule:
        """A copy whose overlapped pairs are ``pairs`` (``flexpipe.ir.overlap``)."""
        return replace(self, overlaps=frozenset((Op(*a), Op(*b)) for a, b in pairs))

    def flattened(self) -> Schedule:
        """A copy with no overlapped pairs: the same ops, one after the other."""
        return replace(self, overlaps=frozenset())

    def renamed(self, name: str) -> Schedule:
        """A copy with another name."""
        return replace(self, name=name)

    def to_text(self) -> str:
        """The compact text form (see ``flexpipe.ir.text``)."""
        from flexpipe.ir.text import format_schedule

        return format_schedule(self)

    def __str__(self) -> str:
        return self.to_text()
