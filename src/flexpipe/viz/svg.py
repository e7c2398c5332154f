"""Self-contained SVG pictures of Traces (simulated or measured): one lane per rank with every op
as a box coloured by its kind (from the registry, so new kinds draw with no edit here) and
labelled with its micro-batch, later chunks on a rank lighter with a dashed outline, ops on other
streams (send/recv, copies, collectives) as thin bars at the bottom of the lane; a time axis; the
activation-memory curve of each rank under the timeline (on one scale, stated in the section
title; a measured trace without memory figures says "not measured" instead of drawing a flat
line); and a metrics line. Times carry their unit on the axis, memory is in KiB/MiB/GiB when
it is bytes (``flexpipe.viz.units``). ``fit`` widens the margins and the picture so that no label
is clipped, whatever the length of the schedule names.

``document`` draws one or several traces stacked on one common time axis (comparisons);
``lanes``, ``memory_rows`` and ``time_axis`` are the building blocks ``flexpipe.viz.html`` reuses
for the predicted-vs-measured overlay; ``pareto`` is re-exported from ``flexpipe.viz.pareto``.
No script, no external resource: the files open offline. Hovering an op shows its details.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from flexpipe.ir.kinds import KINDS, KindRegistry
from flexpipe.sim.trace import Trace
from flexpipe.viz.palette import chunk_of, esc, fill, ink, num, text_width, ticks
from flexpipe.viz.pareto import pareto
from flexpipe.viz.units import MS, UNIT_COST, Units, fmt_memory

__all__ = ["Axis", "Curve", "Lane", "Layout", "document", "fit", "lanes", "legend",
           "memory_rows", "pareto", "svg_root", "time_axis", "trace_block"]

FONT = "font-family='DejaVu Sans, Arial, Helvetica, sans-serif'"
MEM_FILL = "#8e6cd9"
SIZE = re.compile(r"<svg [^>]*?width='(\d+)' height='(\d+)'")
CHAR_W = 6.6  # width of one label character at font-size 11
PAD = 8  # x of the titles and notes
MIN_LABELLED = 8.0  # narrower op boxes carry no label (their tooltip still names the op)


@dataclass(frozen=True)
class Layout:
    """Sizes in pixels: total width, the label column, lane and memory-row heights."""

    width: int = 1200
    left: int = 118
    right: int = 70
    lane_h: int = 22
    mem_h: int = 30
    comm_h: int = 5


@dataclass(frozen=True)
class Axis:
    """Maps trace time ``t0..t1`` onto ``left..left+width`` pixels."""

    t0: float
    t1: float
    left: float
    width: float

    def x(self, t: float) -> float:
        """Pixel column of time ``t``."""
        span = (self.t1 - self.t0) or 1.0
        return self.left + (t - self.t0) / span * self.width

    @staticmethod
    def over(traces: Iterable[Trace], layout: Layout) -> Axis:
        """One axis covering every op of every trace."""
        starts = [t for tr in traces for row in tr.starts for t in row]
        ends = [t for tr in traces for row in tr.ends for t in row]
        t0 = min(starts, default=0.0)
        t1 = max(ends, default=1.0)
        return Axis(t0, t1 if t1 > t0 else t0 + 1.0, layout.left,
                    layout.width - layout.left - layout.right)


class Lane(NamedTuple):
    """One timeline row: rank ``rank`` of ``trace``, headed ``label``."""

    label: str
    trace: Trace
    rank: int


class Curve(NamedTuple):
    """One memory curve to draw: (time, value) steps, filled or as a dashed line."""

    points: Sequence[tuple[float, float]]
    color: str = MEM_FILL
    filled: bool = True
    name: str = ""
    missing: bool = False
    """Not measured: the row says so instead of drawing the curve."""


def memory_curve(trace: Trace, rank: int, **kw: object) -> Curve:
    """Rank ``rank``'s memory curve of ``trace``; a measured trace whose memory is all zero (the
    run did not measure it) gives a ``missing`` curve."""
    points = trace.memory[rank]
    missing = trace.source == "measured" and not any(v for _, v in points)
    return Curve(points, missing=missing, **kw)  # type: ignore[arg-type]


def time_label(traces: Iterable[Trace], units: Units | None = None) -> str:
    """The time axis's title: ``time (ms)`` for measured traces, else the ``units`` the traces
    were simulated in (unit costs when not said)."""
    if all(t.source == "measured" for t in traces):
        return MS.axis
    return (units or UNIT_COST).axis


def time_suffix(trace: Trace, units: Units | None = None) -> str:
    """The unit of ``trace``'s times: ms when measured, else ``units``' (unit costs when not
    said)."""
    return MS.time if trace.source == "measured" else (units or UNIT_COST).time


def svg_root(width: float, height: float, body: Iterable[str]) -> str:
    """A complete standalone ``<svg>`` document."""
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width:.0f}' height='{height:.0f}' "
            f"viewBox='0 0 {width:.0f} {height:.0f}' {FONT} font-size='11'>\n"
            f"<rect width='100%' height='100%' fill='#ffffff'/>\n" + "\n".join(body) + "\n</svg>\n")


def text(x: float, y: float, content: object, size: int = 11, anchor: str = "start",
         weight: str = "normal", color: str = "#222222") -> str:
    """One line of text."""
    return (f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' "
            f"font-weight='{weight}' fill='{color}'>{esc(content)}</text>")


def _op_box(x0: float, x1: float, y: float, h: float, color: str, dashed: bool,
            label: str, tip: str, gang: bool = False) -> list[str]:
    """A filled op box with a tooltip and, when it fits, its label; a gang op (a collective
    pass of a spanning block) has a heavy black outline."""
    dash = " stroke-dasharray='3,2'" if dashed else ""
    stroke = "stroke='#000000' stroke-width='2'" if gang else "stroke='#333333' stroke-width='0.6'"
    out = [f"<rect x='{x0:.2f}' y='{y:.1f}' width='{max(x1 - x0, 0.6):.2f}' height='{h:.1f}' "
           f"fill='{color}' {stroke}{dash}>"
           f"<title>{esc(tip)}</title></rect>"]
    size = next((z for z in (11, 9, 8)
                 if x1 - x0 >= max(MIN_LABELLED, CHAR_W * z / 11 * len(label) + 3)), 0)
    if label and size:
        out.append(text((x0 + x1) / 2, y + h / 2 + size / 3, label, size, "middle",
                        color=ink(color)))
    return out


def _lane_ops(lane: Lane, y: float, ax: Axis, layout: Layout, registry: KindRegistry) -> list[str]:
    trace, r = lane.trace, lane.rank
    chunks = chunk_of(trace.schedule)
    out: list[str] = []
    h = layout.lane_h - 4
    for op, s, e in zip(trace.schedule.ranks[r], trace.starts[r], trace.ends[r], strict=True):
        kind = registry[op.kind]
        chunk, n = chunks.get(op.stage, (0, 1))
        color = fill(kind, chunk, n)
        tip = (f"rank {r}: {op} ({kind.name}, stage {op.stage}, micro-batch {op.mb}) "
               f"{num(s)} to {num(e)}")
        if kind.stream == "compute":
            gang = len(trace.schedule.graph.members(op.stage, op.kind)) > 1
            out += _op_box(ax.x(s), ax.x(e), y + 2, h, color, chunk % 2 == 1, str(op.mb),
                           tip + (" [gang]" if gang else ""), gang)
        else:
            out += _op_box(ax.x(s), ax.x(e), y + layout.lane_h - layout.comm_h - 1,
                           layout.comm_h, color, False, "", tip)
    return out


def lanes(rows: Sequence[Lane], y: float, ax: Axis, layout: Layout,
          registry: KindRegistry = KINDS) -> tuple[list[str], float]:
    """The timeline rows starting at ``y``; returns the elements and the height used."""
    out: list[str] = []
    for i, lane in enumerate(rows):
        top = y + i * layout.lane_h
        shade = "#f4f6f8" if i % 2 == 0 else "#eaedf0"
        out.append(f"<rect x='{ax.left:.1f}' y='{top:.1f}' width='{ax.width:.1f}' "
                   f"height='{layout.lane_h}' fill='{shade}'/>")
        out.append(text(ax.left - 8, top + layout.lane_h / 2 + 4, lane.label, 11, "end"))
        out += _lane_ops(lane, top, ax, layout, registry)
    return out, len(rows) * layout.lane_h


def time_axis(y: float, ax: Axis, label: str = "time") -> tuple[list[str], float]:
    """Ticks and labels along ``y``, the axis title under them at the left; returns the
    elements and the height used."""
    out = [f"<line x1='{ax.left:.1f}' y1='{y:.1f}' x2='{ax.left + ax.width:.1f}' y2='{y:.1f}' "
           f"stroke='#555555'/>"]
    for t in ticks(ax.t0, ax.t1, max(int(ax.width // 80), 2)):
        x = ax.x(t)
        out.append(f"<line x1='{x:.1f}' y1='{y:.1f}' x2='{x:.1f}' y2='{y + 4:.1f}' "
                   f"stroke='#555555'/>")
        out.append(text(x, y + 15, num(t), 10, "middle", color="#444444"))
    out.append(text(ax.left, y + 29, label + " \u2192", 10, color="#444444"))
    return out, 34


def _step_path(points: Sequence[tuple[float, float]], ax: Axis, base: float, h: float,
               vmax: float, closed: bool) -> str:
    """An SVG path of a step curve: the value holds from its time until the next point."""
    def ypix(v: float) -> float:
        return base - (v / vmax) * h if vmax > 0 else base

    x_end = ax.x(ax.t1)
    last: dict[float, float] = {}
    for t, v in points:  # several changes at one time: only the level after them shows
        last[t] = v
    pts = sorted(last.items()) or [(ax.t0, 0.0)]
    d = [f"M{ax.x(ax.t0):.2f},{base:.2f}"]
    for t, v in pts:
        d.append(f"H{min(ax.x(t), x_end):.2f}V{ypix(v):.2f}")
    d.append(f"H{x_end:.2f}")
    if closed:
        d.append(f"V{base:.2f}Z")
    return "".join(d)


def memory_rows(rows: Sequence[tuple[str, Sequence[Curve]]], y: float, ax: Axis,
                layout: Layout, vmax: float) -> tuple[list[str], float]:
    """One small step chart per row (all on one value scale ``vmax``) with its peak labelled."""
    out: list[str] = []
    for i, (label, curves) in enumerate(rows):
        top = y + i * layout.mem_h
        base = top + layout.mem_h - 3
        out.append(f"<rect x='{ax.left:.1f}' y='{top:.1f}' width='{ax.width:.1f}' "
                   f"height='{layout.mem_h}' fill='#fbfaff' stroke='#e2ddf2'/>")
        out.append(text(ax.left - 8, top + layout.mem_h / 2 + 4, label, 10, "end", color="#555"))
        peaks: list[float | None] = []
        for c in curves:
            if c.missing:
                out.append(text(ax.left + 6, top + layout.mem_h / 2 + 4,
                                f"{c.name or 'memory'}: not measured", 10, color="#777"))
                peaks.append(None)
                continue
            path = _step_path(c.points, ax, base, layout.mem_h - 6, vmax, c.filled)
            style = (f"fill='{c.color}' fill-opacity='0.45' stroke='{c.color}'" if c.filled else
                     f"fill='none' stroke='{c.color}' stroke-width='1.5' stroke-dasharray='5,3'")
            out.append(f"<path d='{path}' {style}><title>{esc(c.name or label)}</title></path>")
            peaks.append(max((v for _, v in c.points), default=0.0))
        out.append(text(ax.left + ax.width + 6, top + layout.mem_h / 2 + 4, peak_label(peaks),
                        10, color="#555"))
    return out, len(rows) * layout.mem_h


def peak_label(peaks: Sequence[float | None]) -> str:
    """``peak 1.27 GiB`` (several curves: ``peak a / b``; not measured: ``-``)."""
    return "peak " + " / ".join("-" if p is None else fmt_memory(p) for p in peaks)


def memory_title(vmax: float, what: str) -> str:
    """The memory section's title with its scale: every row's full height is ``vmax``."""
    return f"{what}; full row height = {fmt_memory(vmax)}" if vmax > 0 else what


def summary_line(trace: Trace, registry: KindRegistry = KINDS,
                 units: Units | None = None) -> str:
    """Makespan (with its unit), bubble rate, worst peak activation and peak memory, and where
    it came from."""
    m = trace.metrics(registry)
    unit = " " + time_suffix(trace, units)
    memory = (f"peak activation {fmt_memory(max(m.peak_activation, default=0.0))}  ·  peak "
              f"memory {fmt_memory(max(m.peak_memory, default=0.0))}"
              if not memory_curve(trace, 0).missing else "memory not measured")
    return (f"makespan {num(m.makespan)}{unit}  ·  bubble rate {100 * m.bubble_rate:.2f}%  ·  "
            f"{memory}  ·  {trace.source}  ·  "
            f"{trace.schedule.num_ranks} ranks, {trace.schedule.num_stages} stages, "
            f"{trace.schedule.microbatches} micro-batches")


def memory_peak(traces: Iterable[Trace]) -> float:
    """The largest activation-memory value over every rank of ``traces``."""
    return max((v for tr in traces for curve in tr.memory for _, v in curve), default=0.0)


def trace_block(trace: Trace, y: float, ax: Axis, layout: Layout, vmax: float, title: str = "",
                registry: KindRegistry = KINDS,
                units: Units | None = None) -> tuple[list[str], float]:
    """Title and metrics, the rank lanes, the time axis and the memory rows of one trace."""
    name = title or trace.schedule.name or "schedule"
    out = [text(PAD, y + 15, name, 14, weight="bold"),
           text(PAD, y + 32, summary_line(trace, registry, units), 11, color="#444444")]
    h = 42.0
    n = len(trace.starts)
    elems, dh = lanes([Lane(f"rank {r}", trace, r) for r in range(n)], y + h, ax, layout, registry)
    out += elems
    h += dh + 2
    elems, dh = time_axis(y + h, ax, time_label([trace], units))
    out += elems
    h += dh + 4
    out.append(text(PAD, y + h + 10, memory_title(vmax, "activation memory per rank (device, "
                                                  "parameters excluded)"), 10, color="#555"))
    h += 16
    rows = [(f"mem {r}", [memory_curve(trace, r, name=f"rank {r} memory")]) for r in range(n)]
    elems, dh = memory_rows(rows, y + h, ax, layout, vmax)
    return out + elems, h + dh + 14


def legend(traces: Sequence[Trace], y: float, layout: Layout,
           registry: KindRegistry = KINDS) -> tuple[list[str], float]:
    """A swatch per op kind the traces use (registry order) and the chunk convention."""
    used = {k for tr in traces for k in tr.schedule.kinds()}
    x, row, out = float(PAD), 0, []
    for kind in registry.all():
        if kind.name not in used:
            continue
        label = f"{kind.name}: {kind.doc}"
        w = 24 + text_width(label, 10)
        if x + w > layout.width - 10 and x > PAD:
            x, row = float(PAD), row + 1
        top = y + row * 18
        h = 12 if kind.stream == "compute" else 5
        out.append(f"<rect x='{x:.1f}' y='{top + 12 - h:.1f}' width='16' height='{h}' "
                   f"fill='{fill(kind)}' stroke='#333333' stroke-width='0.6'/>")
        out.append(text(x + 20, top + 11, label, 10))
        x += w
    multi = any(len(s) > 1 for tr in traces for s in tr.schedule.placement.rank_stages)
    gangs = any(tr.schedule.graph.gangs for tr in traces)
    note = ("numbers are micro-batches; thin bars are ops on other streams (communication, "
            "copies)" + ("; later chunks (stages) on a rank are lighter with a dashed outline"
                         if multi else "")
            + ("; heavy outline: gang op (all shards of a spanning block together)"
               if gangs else ""))
    lines = _wrap(note, layout.width - 2 * PAD, 10)
    for i, line in enumerate(lines):
        out.append(text(PAD, y + row * 18 + 32 + 14 * i, line, 10, color="#555555"))
    return out, row * 18 + 26 + 14 * len(lines)


def _wrap(words: str, width: float, size: int) -> list[str]:
    """``words`` in lines no wider than ``width`` pixels at font ``size``."""
    lines: list[str] = []
    for word in words.split(" "):
        if lines and text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def fit(layout: Layout, lines: Iterable[tuple[str, int]], right: Iterable[str] = (),
        left: Iterable[str] = ()) -> Layout:
    """``layout`` widened so that nothing is clipped: each (text, font size) of ``lines`` fits
    from the left edge, the ``right`` labels (size 10) fit after the plot, the ``left`` lane
    labels (size 11) before it."""
    need_left = max((text_width(s, 11) + 16 for s in left), default=0.0)
    need_right = max((text_width(s, 10) + 14 for s in right), default=0.0)
    lay_left = max(layout.left, int(need_left) + 1)
    lay_right = max(layout.right, int(need_right) + 1)
    widest = max((PAD + text_width(s, size, bold=size >= 14) + 12 for s, size in lines),
                 default=0.0)
    width = max(layout.width, int(widest) + 1, lay_left + lay_right + 200)
    return Layout(width, lay_left, lay_right, layout.lane_h, layout.mem_h, layout.comm_h)


def document(traces: Sequence[Trace], titles: Sequence[str] | None = None,
             layout: Layout | None = None, registry: KindRegistry = KINDS,
             units: Units | None = None) -> str:
    """One SVG with every trace stacked on one common time axis and memory scale; ``units``
    are those of the simulated traces' times (default: unit costs; measured traces are in
    ms)."""
    names = [titles[i] if titles else (t.schedule.name or "schedule")
             for i, t in enumerate(traces)]
    vmax = memory_peak(traces)
    peaks = [peak_label([max((v for _, v in c), default=0.0)]) for t in traces for c in t.memory]
    lines = [(n, 14) for n in names] + [(summary_line(t, registry, units), 11) for t in traces]
    lines.append((memory_title(vmax, "activation memory per rank (device, parameters "
                               "excluded)"), 10))
    layout = fit(layout or Layout(), lines, peaks)
    ax = Axis.over(traces, layout)
    body: list[str] = []
    y = 10.0
    for i, trace in enumerate(traces):
        elems, h = trace_block(trace, y, ax, layout, vmax, names[i], registry, units)
        body += elems
        y += h
    elems, h = legend(traces, y, layout, registry)
    return svg_root(layout.width, y + h, body + elems)


def document_size(svg: str) -> tuple[int, int]:
    """(width, height) in pixels of an SVG made by ``svg_root``."""
    m = SIZE.search(svg)
    if m is None:
        raise ValueError("not an SVG made by svg_root: no width/height")
    return int(m.group(1)), int(m.group(2))
