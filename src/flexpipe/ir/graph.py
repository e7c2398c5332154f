"""Stage graphs: which stage feeds which. A chain is the common case; forks and joins use the
same type, so nothing downstream needs a second representation."""

from __future__ import annotations

from dataclasses import dataclass, field

from flexpipe.errors import ConfigError


@dataclass(frozen=True)
class StageGraph:
    """Directed acyclic graph over stages ``0..num_stages-1``; edges are (producer, consumer)."""

    num_stages: int
    edges: tuple[tuple[int, int], ...]
    preds: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    succs: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

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

    @staticmethod
    def chain(num_stages: int) -> StageGraph:
        """Stages in a line: 0 -> 1 -> ... -> num_stages-1."""
        return StageGraph(num_stages, tuple((s, s + 1) for s in range(num_stages - 1)))

    @property
    def is_chain(self) -> bool:
        """True when the graph is the plain chain 0 -> 1 -> ... ."""
        return self.edges == tuple((s, s + 1) for s in range(self.num_stages - 1))

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
