"""Placements: which rank holds each global virtual stage. Linear, interleaved (looped), V-shape
and zig-zag (wave) layouts are constructors of the one ``Placement`` type."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flexpipe.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """``stage_rank[s]`` is the rank that runs stage ``s``; some of ``num_ranks`` may hold none."""

    stage_rank: tuple[int, ...]
    num_ranks: int
    kind: str = field(default="explicit", compare=False)
    rank_stages: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.stage_rank:
            raise ConfigError("a placement needs at least one stage")
        if self.num_ranks < 1:
            raise ConfigError(f"a placement needs at least one rank, got {self.num_ranks}")
        for s, r in enumerate(self.stage_rank):
            if not 0 <= r < self.num_ranks:
                raise ConfigError(
                    f"stage {s} is placed on rank {r}, outside 0..{self.num_ranks - 1}")
        per_rank: list[list[int]] = [[] for _ in range(self.num_ranks)]
        for s, r in enumerate(self.stage_rank):
            per_rank[r].append(s)
        object.__setattr__(self, "rank_stages", tuple(tuple(x) for x in per_rank))

    @property
    def num_stages(self) -> int:
        """Number of global virtual stages."""
        return len(self.stage_rank)

    def rank_of(self, stage: int) -> int:
        """Rank that runs ``stage``."""
        return self.stage_rank[stage]

    @staticmethod
    def linear(p: int) -> Placement:
        """One stage per rank: stage s on rank s."""
        _positive(p=p)
        return Placement(tuple(range(p)), p, "linear")

    @staticmethod
    def interleaved(p: int, v: int) -> Placement:
        """Looped placement, v chunks per rank: stage s on rank s mod p (Megatron interleaved)."""
        _positive(p=p, v=v)
        kind = "interleaved" if v > 1 else "linear"
        return Placement(tuple(s % p for s in range(p * v)), p, kind)

    @staticmethod
    def zigzag(p: int, v: int) -> Placement:
        """Chunks alternate direction: chunk c runs down the ranks when c is even, up when odd.
        v = 2 is the V-shape (rank i holds stages i and 2p-1-i); v = 2w is a Hanayo w-wave."""
        _positive(p=p, v=v)
        ranks = []
        for c in range(v):
            ranks += list(range(p)) if c % 2 == 0 else list(range(p - 1, -1, -1))
        kind = "vshape" if v == 2 else ("linear" if v == 1 else "zigzag")
        return Placement(tuple(ranks), p, kind)

    @staticmethod
    def vshape(p: int) -> Placement:
        """V placement: 2p stages on p ranks, rank i holds stages i and 2p-1-i."""
        return Placement.zigzag(p, 2)

    @staticmethod
    def explicit(stage_rank: Sequence[int], num_ranks: int | None = None) -> Placement:
        """Any mapping; ``num_ranks`` defaults to the largest rank used plus one."""
        ranks = tuple(int(r) for r in stage_rank)
        return Placement(ranks, num_ranks if num_ranks is not None else max(ranks, default=-1) + 1)


def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
