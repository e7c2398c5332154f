"""A self-contained SVG scatter of (time, memory, label) points with the Pareto frontier (the
points no other point beats on both time and memory) drawn as a step line and labelled; the
search and the demo use it to show the time/memory trade-off of candidate schedules. The picture
grows to the right as far as its longest point label needs (no label is clipped); memory in
bytes is labelled in KiB/MiB/GiB."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from flexpipe.errors import ConfigError
from flexpipe.viz.palette import esc, num, text_width, ticks
from flexpipe.viz.units import fmt_memory

Point = tuple[float, float, str]
FRONT = "#d9534f"
OTHER = "#8a99ab"
MAX_LABELS = 40


def frontier(points: Sequence[Point]) -> list[Point]:
    """The Pareto-optimal points (lower time and lower memory are better), by increasing time."""
    best: list[Point] = []
    for p in sorted(points, key=lambda q: (q[0], q[1])):
        if not best or p[1] < best[-1][1]:
            best.append(p)
    return best


def _check(points: Sequence[Point]) -> list[Point]:
    out = []
    for i, p in enumerate(points):
        try:
            t, m, label = p
            t, m = float(t), float(m)
        except (TypeError, ValueError):
            raise ConfigError(f"pareto point {i}: expected (time, memory, label), got "
                              f"{p!r}") from None
        if not (math.isfinite(t) and math.isfinite(m)):
            raise ConfigError(f"pareto point {i} ({label}): time and memory must be finite")
        out.append((t, m, str(label)))
    return out


def _range(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.1, 1.0)
    return lo - pad, hi + pad


def _axes(x0: float, y0: float, w: float, h: float, xr: tuple[float, float],
          yr: tuple[float, float], xlabel: str, ylabel: str,
          yfmt: Callable[[float], str] = num) -> list[str]:
    out = [f"<rect x='{x0}' y='{y0}' width='{w}' height='{h}' fill='#fafbfc' stroke='#555'/>"]
    for t in ticks(xr[0], xr[1], 6):
        x = x0 + (t - xr[0]) / (xr[1] - xr[0]) * w
        out.append(f"<line x1='{x:.1f}' y1='{y0 + h}' x2='{x:.1f}' y2='{y0 + h + 4}' "
                   f"stroke='#555'/><text x='{x:.1f}' y='{y0 + h + 16}' "
                   f"text-anchor='middle' font-size='10'>{num(t)}</text>")
    for v in ticks(yr[0], yr[1], 5):
        y = y0 + h - (v - yr[0]) / (yr[1] - yr[0]) * h
        out.append(f"<line x1='{x0 - 4}' y1='{y:.1f}' x2='{x0}' y2='{y:.1f}' stroke='#555'/>"
                   f"<text x='{x0 - 7}' y='{y + 3:.1f}' text-anchor='end' "
                   f"font-size='10'>{esc(yfmt(v))}</text>")
    out.append(f"<text x='{x0 + w / 2}' y='{y0 + h + 34}' text-anchor='middle' "
               f"font-size='12'>{esc(xlabel)}</text>")
    out.append(f"<text x='16' y='{y0 + h / 2}' text-anchor='middle' font-size='12' "
               f"transform='rotate(-90 16 {y0 + h / 2})'>{esc(ylabel)}</text>")
    return out


def _front_path(front: Sequence[Point], xy: Callable[[Point], tuple[float, float]]) -> str:
    """A staircase through the frontier points: across at the old memory, then down."""
    x, y = xy(front[0])
    d = [f"M{x:.1f},{y:.1f}"]
    for p in front[1:]:
        x, y = xy(p)
        d.append(f"H{x:.1f}V{y:.1f}")
    return "".join(d)


def pareto(points: Sequence[Point], title: str = "time vs memory", width: int = 720,
           height: int = 480, xlabel: str = "iteration time (makespan)",
           ylabel: str = "peak memory") -> str:
    """A standalone SVG scatter of ``points`` = [(time, memory, label)], the Pareto frontier
    highlighted. An empty list draws empty axes with a note."""
    pts = _check(points)
    yfmt = fmt_memory if any(abs(p[1]) >= 1024 for p in pts) else num
    x0 = 24.0 + max((text_width(yfmt(v), 10) for v in ticks(*(_range([p[1] for p in pts])
                                                                if pts else (0.0, 1.0)), 5)),
                    default=30.0)
    y0, w, h = 48.0, width - x0 - 30.0, height - 108.0
    xr = _range([p[0] for p in pts]) if pts else (0.0, 1.0)
    yr = _range([p[1] for p in pts]) if pts else (0.0, 1.0)

    def xy(p: Point) -> tuple[float, float]:
        return (x0 + (p[0] - xr[0]) / (xr[1] - xr[0]) * w,
                y0 + h - (p[1] - yr[0]) / (yr[1] - yr[0]) * h)

    body = [f"<text x='8' y='20' font-size='15' font-weight='bold'>{esc(title)}</text>"]
    body += _axes(x0, y0, w, h, xr, yr, xlabel, ylabel, yfmt)
    front = frontier(pts)
    if front:
        body.append(f"<path d='{_front_path(front, xy)}' fill='none' stroke='{FRONT}' "
                    f"stroke-width='1.5' stroke-dasharray='4,3'/>")
    on_front = set(front)
    labelled = on_front if len(pts) > MAX_LABELS else set(pts)
    right = float(width)
    for p in sorted(pts, key=lambda q: q in on_front):
        x, y = xy(p)
        color, r = (FRONT, 5) if p in on_front else (OTHER, 3.5)
        body.append(f"<circle cx='{x:.1f}' cy='{y:.1f}' r='{r}' fill='{color}' stroke='#222' "
                    f"stroke-width='0.5'><title>{esc(p[2])}: time {num(p[0])}, memory "
                    f"{esc(yfmt(p[1]))}</title></circle>")
        if p in labelled:
            body.append(f"<text x='{x + 7:.1f}' y='{y - 6:.1f}' font-size='10' "
                        f"fill='{'#222' if p in on_front else '#666'}'>{esc(p[2])}</text>")
            right = max(right, x + 7 + text_width(p[2], 10) + 6)
    if not pts:
        body.append(f"<text x='{x0 + w / 2}' y='{y0 + h / 2}' text-anchor='middle'>no points"
                    f"</text>")
    note = f"{len(front)} of {len(pts)} points on the Pareto frontier (red)"
    body.append(f"<text x='8' y='38' font-size='11' fill='#555'>{note}</text>")
    right = max(right, 8 + text_width(title, 15, bold=True) + 8)
    width = int(math.ceil(right))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' font-family='DejaVu Sans, Arial, sans-serif'>\n"
            f"<rect width='100%' height='100%' fill='#ffffff'/>\n" + "\n".join(body) + "\n</svg>\n")
