"""``Trace``: when every op ran and how memory moved, per rank. The simulator and the runtime
return the same type; metrics are computed from it alone, so predicted and measured compare."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple

from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule


class Record(NamedTuple):
    """One op's execution: its rank, the op, start and end time."""

    rank: int
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class Trace:
    """Start and end time of every op (``starts[r][i]`` for ``schedule.ranks[r][i]``), the device
    memory curve per rank as (time, value) steps, and ``static_memory[r]`` held all along
    (parameters). ``source`` is "simulated" or "measured"."""

    schedule: Schedule
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    memory: tuple[tuple[tuple[float, float], ...], ...]
    static_memory: tuple[float, ...]
    source: str = "simulated"

    def records(self, rank: int | None = None) -> list[Record]:
        """Records of one rank, or of all ranks in rank order."""
        ranks = range(len(self.starts)) if rank is None else (rank,)
        out: list[Record] = []
        for r in ranks:
            out += map(Record, repeat(r), self.schedule.ranks[r], self.starts[r], self.ends[r])
        return out

    def metrics(self, registry: KindRegistry = KINDS) -> Metrics:
        """Makespan, bubble rate, per-rank spans, busy times and memory peaks."""
        return compute_metrics(self, registry)


@dataclass(frozen=True)
class Metrics:
    """Summary of a trace. ``bubble_rate`` = 1 - useful work / (ranks x largest rank span), which
    is FACTS.md's (cost - m(T_F+T_B+T_W)) / cost when every rank does the same work."""

    makespan: float
    bubble_rate: float
    span: tuple[float, ...]
    busy: tuple[float, ...]
    useful: tuple[float, ...]
    peak_activation: tuple[float, ...]
    peak_memory: tuple[float, ...]

    def as_dict(self) -> dict[str, object]:
        """JSON-ready dictionary."""
        return {
            "makespan": self.makespan, "bubble_rate": self.bubble_rate,
            "span": list(self.span), "busy": list(self.busy), "useful": list(self.useful),
            "peak_activation": list(self.peak_activation),
            "peak_memory": list(self.peak_memory),
        }


def compute_metrics(trace: Trace, registry: KindRegistry = KINDS) -> Metrics:
    """Metrics of ``trace`` (see ``Metrics``)."""
    spans, busy, useful = [], [], []
    first, last = float("inf"), float("-inf")
    kinds = {k: registry[k] for k in trace.schedule.kinds()}
    for ops, st, en in zip(trace.schedule.ranks, trace.starts, trace.ends, strict=True):
        if not ops:
            spans.append(0.0)
            busy.append(0.0)
            useful.append(0.0)
            continue
        first, last = min(first, min(st)), max(last, max(en))
        comp = [(s, e, kinds[op.kind].useful) for op, s, e in zip(ops, st, en, strict=True)
                if kinds[op.kind].stream == "compute"]
        spans.append(max((e for _, e, _ in comp), default=0.0)
                     - min((s for s, _, _ in comp), default=0.0))
        busy.append(sum(e - s for s, e, _ in comp))
        useful.append(sum(e - s for s, e, u in comp if u))
    cost = max(spans, default=0.0)
    bubble = 1.0 - sum(useful) / (len(spans) * cost) if cost > 0 else 0.0
    peaks = tuple(max(v for _, v in curve) for curve in trace.memory)
    return Metrics(
        makespan=(last - first) if last >= first else 0.0,
        bubble_rate=max(0.0, bubble),
        span=tuple(spans), busy=tuple(busy), useful=tuple(useful),
        peak_activation=peaks,
        peak_memory=tuple(p + s for p, s in zip(peaks, trace.static_memory, strict=True)),
    )
