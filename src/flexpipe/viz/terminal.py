"""Terminal views of a Trace: a timeline with one row per rank, time scaled to the width, each op a
cell labelled with its micro-batch, coloured (or, without colour, lettered) by its op kind's
registry entry (``OpKind.color``/``glyph``), so new kinds draw with no edit here; and a metrics
table. Works from any Trace, simulated or measured.

When a rank holds several stages (interleaved, V-shape), a cell's shade tells its chunk apart: a
lighter tint of the kind colour for later chunks, or in plain text a lower-case glyph for odd
chunks. Idle time is ``.``; ops on other streams (send/recv) are not drawn.

``compact_timeline`` keeps every cell readable at any width (80 columns included) for schedules
with many short ops (V-shape, interleaved): time is scaled so that the shortest op still holds
its label, and the timeline wraps into bands of the available width, each with its own axis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rich.color import Color, ColorParseError
from rich.style import Style
from rich.table import Table
from rich.text import Text

from flexpipe.ir.kinds import KINDS, KindRegistry, OpKind
from flexpipe.ir.op import Op
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.trace import Metrics, Trace
from flexpipe.viz.palette import chunk_of, nice_step
from flexpipe.viz.units import (
    UNIT_COST,
    Units,
    bubble_definition,
    fmt_memory,
    fmt_time,
    memory_note,
)

IDLE = "."
IDLE_STYLE = Style(dim=True)
MIN_BAR = 10


@dataclass(frozen=True)
class Cell:
    """One op on the timeline: columns [start, end), its text and style."""

    start: int
    end: int
    label: str
    style: Style | None


def _shade(color: str, chunk: int, chunks: int) -> Color:
    """The kind colour for chunk 0, tinted towards white for later chunks."""
    try:
        base = Color.parse(color)
    except ColorParseError:
        base = Color.parse("white")
    if chunk == 0 or chunks < 2:
        return base
    r, g, b = base.get_truecolor()
    f = 0.55 * chunk / (chunks - 1)
    return Color.from_rgb(*(c + (255 - c) * f for c in (r, g, b)))


def _style(kind: OpKind, chunk: int, chunks: int) -> Style:
    bg = _shade(kind.color, chunk, chunks)
    r, g, b = bg.get_truecolor()
    light = 0.299 * r + 0.587 * g + 0.114 * b > 140
    return Style(color="black" if light else "bright_white", bgcolor=bg)


def _label(op: Op, kind: OpKind, chunk: int, color: bool, gang: bool = False) -> str:
    if color:
        return str(op.mb)
    glyph = kind.glyph.lower() if chunk % 2 else kind.glyph
    return f"{glyph}{op.mb}" + ("=" if gang else "")


def _ganged(schedule: Schedule, op: Op) -> bool:
    """Whether ``op`` runs together with the other stages of its gang (a collective pass)."""
    return len(schedule.graph.members(op.stage, op.kind)) > 1


def _time_range(trace: Trace) -> tuple[float, float]:
    starts = [t for row in trace.starts for t in row]
    ends = [t for row in trace.ends for t in row]
    if not starts:
        return 0.0, 1.0
    t0, t1 = min(starts), max(ends)
    return t0, (t1 - t0) or 1.0


def rank_cells(trace: Trace, rank: int, bar: int, color: bool,
               registry: KindRegistry = KINDS) -> list[Cell]:
    """The cells of one rank's compute ops, scaled to ``bar`` columns."""
    t0, span = _time_range(trace)
    scale = bar / span
    chunks = chunk_of(trace.schedule)
    cells = []
    for op, s, e in zip(trace.schedule.ranks[rank], trace.starts[rank], trace.ends[rank],
                        strict=True):
        kind = registry[op.kind]
        if kind.stream != "compute":
            continue
        a = min(round((s - t0) * scale), bar - 1)
        b = min(max(round((e - t0) * scale), a + 1), bar)
        chunk, n = chunks[op.stage]
        gang = _ganged(trace.schedule, op)
        style = _style(kind, chunk, n) if color else None
        if style is not None and gang:
            style = style + Style(underline=True, bold=True)
        cells.append(Cell(a, b, _label(op, kind, chunk, color, gang), style))
    return cells


def _cells_to_columns(cells: Sequence[Cell], bar: int) -> tuple[list[str], list[Style | None]]:
    """The characters and styles of ``bar`` columns holding ``cells``."""
    chars: list[str] = [IDLE] * bar
    styles: list[Style | None] = [IDLE_STYLE] * bar
    for cell in cells:
        width = cell.end - cell.start
        text = cell.label[:width].ljust(width)
        chars[cell.start:cell.end] = text
        styles[cell.start:cell.end] = [cell.style] * width
    return chars, styles


def _row(cells: Sequence[Cell], bar: int) -> Text:
    return _text(*_cells_to_columns(cells, bar))


def _text(chars: Sequence[str], styles: Sequence[Style | None]) -> Text:
    """Columns as rich Text, one span per run of one style."""
    bar = len(chars)
    row = Text()
    i = 0
    while i < bar:
        j = i
        while j < bar and styles[j] is styles[i]:
            j += 1
        row.append("".join(chars[i:j]), styles[i])
        i = j
    return row


def axis(t0: float, span: float, bar: int, indent: int) -> str:
    """A time axis under the rows: ``|`` ticks at round times, labelled where they fit."""
    step = nice_step(span, max(bar // 12, 1))
    marks = [" "] * (bar + 8)
    labels = [" "] * (bar + 8)
    k = 0
    while k * step <= span + 1e-9:
        col = min(round(k * step / span * bar), bar - 1)
        marks[col] = "|"
        text = f"{t0 + k * step:g}"
        if all(c == " " for c in labels[max(col - 1, 0):col + len(text) + 1]):
            labels[col:col + len(text)] = text
        k += 1
    pad = " " * indent
    return f"{pad}{''.join(marks).rstrip()}\n{pad}{''.join(labels).rstrip()}"


def timeline(trace: Trace, width: int = 100, color: bool = True,
             registry: KindRegistry = KINDS, units: Units = UNIT_COST) -> Text:
    """The whole timeline: one row per rank, then a time axis, then the legend."""
    n = len(trace.starts)
    prefix = [f"rank {r:>{len(str(n - 1))}} |" for r in range(n)]
    indent = len(prefix[0]) if prefix else 0
    bar = _bar(trace, width)
    out = Text()
    for r in range(n):
        out.append(prefix[r])
        out.append_text(_row(rank_cells(trace, r, bar, color, registry), bar))
        out.append("|\n")
    t0, span = _time_range(trace)
    out.append(axis(t0, span, bar, indent) + "\n")
    out.append_text(legend(trace.schedule, color, registry, units))
    return out


MAX_BANDS = 16
"""The compact view wraps into this many bands at most (a cost model with near-zero ops would
otherwise ask for millions of columns)."""


def _bar(trace: Trace, width: int) -> int:
    """Columns of the timeline's bar at ``width`` (after the ``rank N |`` prefix)."""
    indent = len(f"rank {len(trace.starts) - 1} |")
    return max(width - indent - 1, MIN_BAR)


def needs_compact(trace: Trace, width: int, color: bool = True,
                  registry: KindRegistry = KINDS) -> bool:
    """Whether the one-band timeline at ``width`` would give the shortest op fewer columns than
    its label (micro-batch, and its glyph without colour): labels would be cut and cells run
    together (``FF1FF3fb0wfb1``); then ``compact_timeline`` reads better."""
    _, span = _time_range(trace)
    label = _digits(trace) + (0 if color else 1)
    return span * label / _shortest(trace, registry) > _bar(trace, width) + 1e-9


def compact_timeline(trace: Trace, width: int = 80, color: bool = True,
                     registry: KindRegistry = KINDS, units: Units = UNIT_COST) -> Text:
    """The timeline in bands of ``width`` columns, scaled so that the shortest op holds its
    label (micro-batch, with its glyph without colour) plus a space, in ``MAX_BANDS`` bands at
    most (ops too short for that scale go without a label); then the legend."""
    n = len(trace.starts)
    prefix = [f"rank {r:>{len(str(n - 1))}} |" for r in range(n)]
    indent = len(prefix[0]) if prefix else 0
    bar = _bar(trace, width)
    t0, span = _time_range(trace)
    total = max(bar, min(math.ceil(span * _columns_per_unit(trace, color, registry)),
                         MAX_BANDS * bar))
    cells = [rank_cells(trace, r, total, color, registry) for r in range(n)]
    rows = [_cells_to_columns(row, total) for row in cells]
    out = Text()
    for lo, hi in _bands(cells, total, bar):
        for r in range(n):
            out.append(prefix[r])
            out.append_text(_text(rows[r][0][lo:hi], rows[r][1][lo:hi]))
            out.append("|\n")
        out.append(axis(t0 + lo / total * span, (hi - lo) / total * span, hi - lo, indent)
                   + "\n\n")
    out.append_text(legend(trace.schedule, color, registry, units))
    return out


def _bands(cells: Sequence[Sequence[Cell]], total: int, bar: int) -> list[tuple[int, int]]:
    """[lo, hi) column ranges of at most ``bar`` columns, cut where no cell of any rank
    straddles the cut when the band's second half has such a column, else where no label is
    split (a long cell then goes on, blank, in the next band)."""
    inside = {c for row in cells for cell in row for c in range(cell.start + 1, cell.end)}
    labels = {c for row in cells for cell in row
              for c in range(cell.start + 1, cell.start + len(cell.label) + 1)}
    out, lo = [], 0
    while lo < total:
        hi = min(lo + bar, total)
        if hi < total:
            span = range(hi, lo + bar // 2, -1)
            hi = next((c for c in span if c not in inside),
                      next((c for c in span if c not in labels), hi))
        out.append((lo, hi))
        lo = hi
    return out


def _columns_per_unit(trace: Trace, color: bool, registry: KindRegistry) -> float:
    """Columns per unit of time that give the shortest compute op room for its label and a
    space (one column more for rounding)."""
    label = _digits(trace) + (0 if color else 2)
    return (label + 2) / _shortest(trace, registry)


def _digits(trace: Trace) -> int:
    """Characters of the largest micro-batch number."""
    return len(str(max(trace.schedule.microbatches - 1, 0)))


def _shortest(trace: Trace, registry: KindRegistry) -> float:
    """The shortest compute op's duration (1 when there is none)."""
    return min((e - s for r, ops in enumerate(trace.schedule.ranks)
                for op, s, e in zip(ops, trace.starts[r], trace.ends[r], strict=True)
                if registry[op.kind].stream == "compute" and e > s), default=1.0)


def legend(schedule: Schedule, color: bool = True, registry: KindRegistry = KINDS,
           units: Units = UNIT_COST) -> Text:
    """One entry per op kind the schedule uses, in registration order; then the cell, chunk
    and gang conventions and the axis's unit."""
    used = schedule.kinds()
    out = Text()
    for kind in registry.all():
        if kind.name not in used or kind.stream != "compute":
            continue
        swatch = Text(f" {kind.glyph} ", _style(kind, 0, 1)) if color else Text(kind.glyph)
        out.append_text(swatch)
        name = f" {kind.name}" if kind.name != kind.glyph else ""
        out.append(f"{name} {kind.doc}   ")
    multi = any(len(s) > 1 for s in schedule.placement.rank_stages)
    if multi:
        out.append("\n(later chunks on a rank are " +
                   ("lighter)" if color else "lower-case on odd chunks)"))
    if schedule.graph.gangs:
        out.append("\n(gang ops, run by all shards of a spanning block together, are " +
                   ("underlined)" if color else "marked '=')"))
    cell = "micro-batch" if color else "glyph + micro-batch"
    out.append(f"\ncells: {cell}; '{IDLE}' idle; axis: {units.axis}")
    return out


def fmt(x: float) -> str:
    """A number for tables: up to 4 significant digits, no trailing zeros."""
    return f"{x:.4g}"


def metrics_table(metrics: Metrics, title: str = "", units: Units = UNIT_COST) -> Table:
    """Per-rank span, busy time, useful-work share, peak activation and peak memory: the times
    in ``units`` (named in the headers), the memory with its unit in every cell."""
    table = Table(title=title or None, title_justify="left")
    for col in ("rank", f"span ({units.time})", f"busy ({units.time})", "idle %",
                "peak activation", "peak memory"):
        table.add_column(col, justify="right")
    cost = max(metrics.span, default=0.0)
    for r, span in enumerate(metrics.span):
        idle = 100.0 * (1 - metrics.useful[r] / cost) if cost > 0 else 0.0
        table.add_row(str(r), fmt(span), fmt(metrics.busy[r]), f"{idle:.1f}",
                      fmt_memory(metrics.peak_activation[r]), fmt_memory(metrics.peak_memory[r]))
    return table


def summary(metrics: Metrics, units: Units = UNIT_COST) -> str:
    """Makespan (with its unit), bubble rate and the worst rank's peak activation (with its
    unit); then what the units are and which bubble rate it is."""
    peak = max(metrics.peak_activation, default=0.0)
    return (f"makespan {fmt_time(metrics.makespan, units)}   bubble rate "
            f"{metrics.bubble_rate:.4f} ({100 * metrics.bubble_rate:.2f}%)   peak activation "
            f"{fmt_memory(peak)} (worst rank)\n"
            f"units: {units.note}; {memory_note(peak)}\n"
            f"bubble rate: {bubble_definition(metrics.useful)}")
