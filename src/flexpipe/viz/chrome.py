"""Chrome trace / Perfetto JSON of simulated and measured Traces (open in https://ui.perfetto.dev
or chrome://tracing; both read the file locally).

Layout of the file (the Trace Event Format's JSON object form)::

    {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}

- one process (``pid``) per rank, named ``rank R`` (``NAME · rank R`` when several traces share a
  file; trace i's ranks are pids ``i * PID_STRIDE + R``);
- one thread (``tid``) per stream of that rank: 0 is ``compute``, then the other streams the
  op kinds declare (send, recv, d2h, ...) in order of first use;
- one complete event (``ph: "X"``) per op: ``name`` is the op (``3F1``), ``cat`` its kind,
  ``args`` {op, kind, stage, mb, chunk};
- counter events (``ph: "C"``, name ``memory``) with the rank's activation memory after each
  change (one per distinct time).

Time unit: Trace times are in the cost model's unit -- milliseconds by FlexPipe's convention
(the papers, the transformer cost model and the runtime's measured traces all use ms). Chrome
trace timestamps (``ts``, ``dur``) are microseconds, so ``ts = t * us_per_unit`` with
``us_per_unit = 1000`` by default; pass another factor for traces in other units (e.g. 1e6 for
seconds). The unit-cost default model's "1" therefore shows as 1 ms.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from flexpipe.errors import ConfigError
from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.sim.trace import Trace
from flexpipe.viz.palette import chunk_of

US_PER_MS = 1000.0
PID_STRIDE = 1000
Event = dict[str, Any]


def _meta(name: str, pid: int, args: dict[str, Any], tid: int | None = None) -> Event:
    event: Event = {"ph": "M", "name": name, "pid": pid, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _streams(trace: Trace, rank: int, registry: KindRegistry) -> dict[str, int]:
    """stream name -> tid for one rank: compute first, then others in order of first use."""
    tids = {"compute": 0}
    for op in trace.schedule.ranks[rank]:
        tids.setdefault(registry[op.kind].stream, len(tids))
    return tids


def _counters(trace: Trace, rank: int, pid: int, scale: float) -> list[Event]:
    """The rank's memory curve, the last value at each distinct time."""
    last: dict[float, float] = {}
    for t, v in trace.memory[rank]:
        last[t] = v
    return [{"ph": "C", "name": "memory", "pid": pid, "ts": t * scale,
             "args": {"activation": v}} for t, v in sorted(last.items())]


def rank_events(trace: Trace, rank: int, pid: int, label: str = "",
                us_per_unit: float = US_PER_MS, registry: KindRegistry = KINDS) -> list[Event]:
    """Metadata, one "X" event per op and the memory counters of one rank."""
    tids = _streams(trace, rank, registry)
    name = f"{label} · rank {rank}" if label else f"rank {rank}"
    out = [_meta("process_name", pid, {"name": name}),
           _meta("process_sort_index", pid, {"sort_index": pid})]
    out += [_meta("thread_name", pid, {"name": s}, tid) for s, tid in tids.items()]
    chunks = chunk_of(trace.schedule)
    for op, s, e in zip(trace.schedule.ranks[rank], trace.starts[rank], trace.ends[rank],
                        strict=True):
        out.append({"ph": "X", "name": str(op), "cat": op.kind, "pid": pid,
                    "tid": tids[registry[op.kind].stream], "ts": s * us_per_unit,
                    "dur": max(e - s, 0.0) * us_per_unit,
                    "args": {"op": str(op), "kind": op.kind, "stage": op.stage, "mb": op.mb,
                             "chunk": chunks.get(op.stage, (0, 1))[0]}})
    return out + _counters(trace, rank, pid, us_per_unit)


def chrome_trace(traces: Sequence[Trace], titles: Sequence[str] | None = None,
                 us_per_unit: float = US_PER_MS, registry: KindRegistry = KINDS) -> dict[str, Any]:
    """The trace file's JSON object for one or several traces (see the module docstring)."""
    if not traces:
        raise ConfigError("nothing to export: no traces given")
    if not us_per_unit > 0:
        raise ConfigError(f"us_per_unit must be positive, got {us_per_unit!r}")
    names = list(titles) if titles else [t.schedule.name for t in traces]
    several = len(traces) > 1
    events: list[Event] = []
    for i, trace in enumerate(traces):
        label = (names[i] or f"schedule {i + 1}") if several else ""
        for r in range(len(trace.starts)):
            events += rank_events(trace, r, i * PID_STRIDE + r, label, us_per_unit, registry)
    info = [{"name": names[i], "source": t.source, "ranks": t.schedule.num_ranks,
             "microbatches": t.schedule.microbatches, "makespan": t.metrics(registry).makespan}
            for i, t in enumerate(traces)]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": "flexpipe", "us_per_unit": us_per_unit, "traces": info}}


def dumps(traces: Sequence[Trace], titles: Sequence[str] | None = None,
          us_per_unit: float = US_PER_MS) -> str:
    """``chrome_trace`` as JSON text."""
    return json.dumps(chrome_trace(traces, titles, us_per_unit), separators=(",", ":")) + "\n"
