"""``Trace``: when every op ran and how memory moved, per rank. The simulator and the runtime
return the same type; metrics are computed from it alone, so predicted and measured compare."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

import numpy as np

from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule


class Record(NamedTuple):
    """One op's execution: its rank, the op, start and end time."""

    rank: int
    op: Op
    start: float
    end: float


Curves = tuple[tuple[tuple[float, float], ...], ...]
MemoryData = tuple[Curves, tuple[float, ...]]


@dataclass(frozen=True, eq=False)
class Trace:
    """Start and end time of every op (``starts[r][i]`` for ``schedule.ranks[r][i]``) and the
    memory: ``memory[r]`` is rank r's device-memory curve as (time, value) steps and
    ``static_memory[r]`` what it holds all along (parameters). ``memory_data`` is that pair, or a
    function computing it on first use (the simulator's timing does not wait for it).
    ``source`` is "simulated" or "measured"."""

    schedule: Schedule
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    memory_data: MemoryData | Callable[[], MemoryData] = field(repr=False)
    source: str = "simulated"

    @cached_property
    def _memory(self) -> MemoryData:
        data = self.memory_data
        return data() if callable(data) else data

    @property
    def memory(self) -> Curves:
        """Device-memory curve per rank."""
        return self._memory[0]

    @property
    def static_memory(self) -> tuple[float, ...]:
        """Memory held all along per rank (parameters not moved by the schedule)."""
        return self._memory[1]

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


BUBBLE_DEFINITION = (
    "bubble rate = 1 - useful work / (ranks x largest per-rank span); a rank's span runs from "
    "the start of its first pass to the end of its last (communication waits included); useful "
    "work = F, B, W, BW passes. It is the zero-bubble paper's (span - m(T_F+T_B+T_W)) / span "
    "when every rank does the same work; with uneven stages it also counts the lighter ranks' "
    "idle time.")


@dataclass(frozen=True)
class Metrics:
    """Summary of a trace. ``bubble_rate`` = 1 - useful work / (ranks x largest rank span), which
    is docs/facts.md's (cost - m(T_F+T_B+T_W)) / cost when every rank does the same work."""

    makespan: float
    bubble_rate: float
    span: tuple[float, ...]
    busy: tuple[float, ...]
    useful: tuple[float, ...]
    peak_activation: tuple[float, ...]
    peak_memory: tuple[float, ...]

    @property
    def bubble_definition(self) -> str:
        """What ``bubble_rate`` measures, in words (for reports that print it)."""
        return BUBBLE_DEFINITION

    def as_dict(self) -> dict[str, object]:
        """JSON-ready dictionary (with the bubble rate's definition)."""
        return {
            "makespan": self.makespan, "bubble_rate": self.bubble_rate,
            "bubble_definition": BUBBLE_DEFINITION,
            "span": list(self.span), "busy": list(self.busy), "useful": list(self.useful),
            "peak_activation": list(self.peak_activation),
            "peak_memory": list(self.peak_memory),
        }


def compute_metrics(trace: Trace, registry: KindRegistry = KINDS) -> Metrics:
    """Metrics of ``trace`` (see ``Metrics``)."""
    kinds = {k: registry[k] for k in trace.schedule.kinds()}
    code = {k: (2 if spec.useful else 1) if spec.stream == "compute" else 0
            for k, spec in kinds.items()}
    spans, busy, useful = [], [], []
    first, last = float("inf"), float("-inf")
    seconds = {b for _, b in trace.schedule.overlaps}  # a pair's slot counts once
    for ops, st, en in zip(trace.schedule.ranks, trace.starts, trace.ends, strict=True):
        if not ops:
            spans.append(0.0)
            busy.append(0.0)
            useful.append(0.0)
            continue
        s, e = np.asarray(st, dtype=float), np.asarray(en, dtype=float)
        first, last = min(first, float(s.min())), max(last, float(e.max()))
        c = np.fromiter(map(code.__getitem__, map(itemgetter(0), ops)), np.int64, len(ops))
        comp = c > 0
        spans.append(float(e[comp].max() - s[comp].min()) if comp.any() else 0.0)
        if seconds:
            c = np.where([op in seconds for op in ops], 0, c)
            comp = c > 0
        busy.append(float((e - s)[comp].sum()))
        useful.append(float((e - s)[c == 2].sum()))
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
