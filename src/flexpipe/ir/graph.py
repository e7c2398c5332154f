"""Stage graphs: which stage feeds which. A chain is the common case; forks and joins use the
same type, so nothing downstream needs a second representation.

A block that spans several devices (a tensor-parallel or vocabulary-sharded embedding or head)
is one *shard stage* per device plus a *gang*: a tuple of stages whose ops of the same kind and
micro-batch start together, as a collective would (see docs/graphs.md). ``gang_kinds`` says, per
gang, which op kinds are collective (empty: every kind); the others run on each shard alone."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from flexpipe.errors import ConfigError

KIND_NAME = re.compile(r"[A-Z][A-Z_]*\Z")


@dataclass(frozen=True)
class StageGraph:
    """Directed acyclic graph over stages ``0..num_stages-1``; edges are (producer, consumer)."""

    num_stages: int
    edges: tuple[tuple[int, int], ...]
    gangs: tuple[tuple[int, ...], ...] = ()
    gang_kinds: tuple[tuple[str, ...], ...] = ()
    preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    gang_of: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    kinds_of: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ConfigError(f"a stage graph needs at least one stage, got {self.num_stages}")
        preds: list[list[int]] = [[] for _ in range(self.num_stages)]
        succs: list[list[int]] = [[] for _ in range(self.num_stages)]
        for a, b in self.edges:
            if not (0 <= a < self.num_stages and 0 <= b < self.num_stages):
                raise ConfigError(f"edge {a}>{b} names a stage outside 0..{self.num_stages - 1}")
            if a == b or b in succs[a]:
                raise ConfigError(f"edge {a}>{b} is a self-loop or repeated")
            succs[a].append(b)
            preds[b].append(a)
        object.__setattr__(self, "preds", tuple(tuple(x) for x in preds))
        object.__setattr__(self, "succs", tuple(tuple(x) for x in succs))
        _check_acyclic(self)
        object.__setattr__(self, "gangs", tuple(tuple(int(s) for s in g) for g in self.gangs))
        object.__setattr__(self, "gang_of", _gang_table(self))
        object.__setattr__(self, "kinds_of", _kinds_table(self))

    @staticmethod
    def chain(num_stages: int) -> StageGraph:
        """Stages in a line: 0 -> 1 -> ... -> num_stages-1."""
        return StageGraph(num_stages, tuple((s, s + 1) for s in range(num_stages - 1)))

    @property
    def chain_edges(self) -> bool:
        """True when the edges are the plain chain 0 -> 1 -> ... (gangs aside)."""
        return self.edges == tuple((s, s + 1) for s in range(self.num_stages - 1))

    @property
    def is_chain(self) -> bool:
        """True when the graph is the plain chain 0 -> 1 -> ... with no gangs."""
        return not self.gangs and self.chain_edges

    def members(self, stage: int, kind: str) -> tuple[int, ...]:
        """The stages whose ``kind`` ops start together with ``stage``'s (``(stage,)`` when it
        runs alone or ``kind`` is not collective in its gang)."""
        gang = self.gang_of[stage]
        kinds = self.kinds_of[stage]
        return gang if not kinds or kind in kinds else (stage,)

    def peers(self, stage: int, kind: str) -> tuple[int, ...]:
        """The other stages of ``stage``'s gang whose ``kind`` ops start with its own."""
        return tuple(t for t in self.members(stage, kind) if t != stage)

    def topological(self) -> tuple[int, ...]:
        """Stages in a topological order (smallest ready stage first)."""
        indegree = [len(p) for p in self.preds]
        ready = [s for s in range(self.num_stages) if indegree[s] == 0]
        out: list[int] = []
        while ready:
            ready.sort()
            s = ready.pop(0)
            out.append(s)
            for t in self.succs[s]:
                indegree[t] -= 1
                if indegree[t] == 0:
                    ready.append(t)
        return tuple(out)

    def sources(self) -> tuple[int, ...]:
        """Stages with no producer (they read the inputs)."""
        return tuple(s for s in range(self.num_stages) if not self.preds[s])

    def sinks(self) -> tuple[int, ...]:
        """Stages with no consumer (they compute the loss)."""
        return tuple(s for s in range(self.num_stages) if not self.succs[s])


def _check_acyclic(graph: StageGraph) -> None:
    indegree = [len(p) for p in graph.preds]
    ready = [s for s in range(graph.num_stages) if indegree[s] == 0]
    seen = 0
    while ready:
        s = ready.pop()
        seen += 1
        for t in graph.succs[s]:
            indegree[t] -= 1
            if indegree[t] == 0:
                ready.append(t)
    if seen != graph.num_stages:
        raise ConfigError("the stage graph has a cycle; stages must form a DAG")


def _gang_table(graph: StageGraph) -> tuple[tuple[int, ...], ...]:
    """Per stage, the gang holding it (``(s,)`` alone); a ConfigError for a malformed gang."""
    table: list[tuple[int, ...]] = [(s,) for s in range(graph.num_stages)]
    for g in graph.gangs:
        if len(g) < 2 or len(set(g)) != len(g):
            raise ConfigError(f"gang {_show(g)} needs at least two distinct stages")
        for s in g:
            if not 0 <= s < graph.num_stages:
                raise ConfigError(f"gang {_show(g)} names stage {s}, outside "
                                  f"0..{graph.num_stages - 1}")
            if len(table[s]) > 1:
                raise ConfigError(f"stage {s} is in two gangs ({_show(table[s])} and {_show(g)})")
            table[s] = g
    for a, b in graph.edges:
        if table[a] is table[b] and len(table[a]) > 1:
            raise ConfigError(f"edge {a}>{b} joins two stages of gang {_show(table[a])}; "
                              f"a gang's stages run together and cannot feed each other")
    return tuple(table)


def _kinds_table(graph: StageGraph) -> tuple[tuple[str, ...], ...]:
    """Per stage, its gang's collective kinds (empty: all); checks ``gang_kinds``."""
    kinds = tuple(tuple(str(k) for k in ks) for ks in graph.gang_kinds)
    if kinds and len(kinds) != len(graph.gangs):
        raise ConfigError(f"gang_kinds lists {len(kinds)} entries for {len(graph.gangs)} gangs")
    for ks in kinds:
        for k in ks:
            if not KIND_NAME.match(k):
                raise ConfigError(f"gang kind {k!r} is not an op kind name (upper-case letters)")
    object.__setattr__(graph, "gang_kinds", kinds if any(kinds) else ())
    table: list[tuple[str, ...]] = [() for _ in range(graph.num_stages)]
    for g, ks in zip(graph.gangs, kinds, strict=False):
        for s in g:
            table[s] = ks
    return tuple(table)


def _show(gang: tuple[int, ...]) -> str:
    return ",".join(map(str, gang))
