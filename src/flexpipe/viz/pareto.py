"""A self-contained SVG scatter of (time, memory, label) points with the Pareto frontier (the
points no other point beats on both time and memory) drawn as a step line; the search and the
demo use it to show the time/memory trade-off of candidate schedules.

The memory limit that decided the winner is drawn as a dashed line, the winner is ringed and
labelled first, and every label stays inside the plot: it goes to whichever side of its point
has room and does not cover another label (a label that finds no free place is left to the
point's tooltip rather than drawn on top of another). Memory in bytes is labelled in
KiB/MiB/GiB, otherwise in M_B."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flexpipe.errors import ConfigError
from flexpipe.viz.palette import esc, num, text_width, ticks
from flexpipe.viz.units import fmt_memory

Point = tuple[float, float, str]
Box = tuple[float, float, float, float]
FRONT = "#d9534f"
OTHER = "#8a99ab"
LIMIT = "#7a5cc2"
MAX_LABELS = 40
LABEL = 10  # font size of point labels


@dataclass(frozen=True)
class Plot:
    """The plot area in pixels and the value ranges it shows."""

    x0: float
    y0: float
    w: float
    h: float
    xr: tuple[float, float]
    yr: tuple[float, float]

    def xy(self, t: float, m: float) -> tuple[float, float]:
        """Pixel position of (time, memory)."""
        return (self.x0 + (t - self.xr[0]) / (self.xr[1] - self.xr[0]) * self.w,
                self.y0 + self.h - (m - self.yr[0]) / (self.yr[1] - self.yr[0]) * self.h)


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
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.1, 1.0)
    return lo - pad, hi + pad


def _axes(plot: Plot, xlabel: str, ylabel: str, yfmt: Callable[[float], str]) -> list[str]:
    x0, y0, w, h = plot.x0, plot.y0, plot.w, plot.h
    out = [f"<rect x='{x0:.1f}' y='{y0}' width='{w:.1f}' height='{h}' fill='#fafbfc' "
           f"stroke='#555'/>"]
    for t in ticks(*plot.xr, 6):
        x = plot.xy(t, plot.yr[0])[0]
        out.append(f"<line x1='{x:.1f}' y1='{y0 + h}' x2='{x:.1f}' y2='{y0 + h + 4}' "
                   f"stroke='#555'/><text x='{x:.1f}' y='{y0 + h + 16}' "
                   f"text-anchor='middle' font-size='10'>{num(t)}</text>")
    for v in ticks(*plot.yr, 5):
        y = plot.xy(plot.xr[0], v)[1]
        out.append(f"<line x1='{x0 - 4:.1f}' y1='{y:.1f}' x2='{x0:.1f}' y2='{y:.1f}' "
                   f"stroke='#555'/><text x='{x0 - 7:.1f}' y='{y + 3:.1f}' text-anchor='end' "
                   f"font-size='10'>{esc(yfmt(v))}</text>")
    out.append(f"<text x='{x0 + w / 2:.1f}' y='{y0 + h + 34}' text-anchor='middle' "
               f"font-size='12'>{esc(xlabel)}</text>")
    out.append(f"<text x='16' y='{y0 + h / 2}' text-anchor='middle' font-size='12' "
               f"transform='rotate(-90 16 {y0 + h / 2})'>{esc(ylabel)}</text>")
    return out


def _front_path(front: Sequence[Point], plot: Plot) -> str:
    """A staircase through the frontier points: across at the old memory, then down."""
    x, y = plot.xy(front[0][0], front[0][1])
    d = [f"M{x:.1f},{y:.1f}"]
    for p in front[1:]:
        x, y = plot.xy(p[0], p[1])
        d.append(f"H{x:.1f}V{y:.1f}")
    return "".join(d)


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_label(text: str, x: float, y: float, plot: Plot, taken: list[Box],
                size: float = LABEL) -> tuple[float, float, str] | None:
    """Where ``text`` goes beside the point (x, y): (x, baseline y, text-anchor) of the first
    of right-above, right-below, left-above, left-below that lies inside the plot and covers
    no box in ``taken`` (which it joins); None when none does."""
    width = text_width(text, size)
    for dx, dy in ((7, -6), (7, size + 4), (-7, -6), (-7, size + 4)):
        left = x + dx if dx > 0 else x + dx - width
        box = (left, y + dy - size, left + width, y + dy + 2)
        inside = (box[0] >= plot.x0 + 2 and box[2] <= plot.x0 + plot.w - 2
                  and box[1] >= plot.y0 + 2 and box[3] <= plot.y0 + plot.h - 2)
        if inside and not any(_overlaps(box, t) for t in taken):
            taken.append(box)
            return x + dx, y + dy, "start" if dx > 0 else "end"
    return None


def _limit_line(limit: float, plot: Plot, yfmt: Callable[[float], str],
                taken: list[Box]) -> list[str]:
    """The memory limit as a dashed line across the plot, labelled at its left end."""
    _, y = plot.xy(plot.xr[0], limit)
    label = f"memory limit {yfmt(limit)}"
    box = (plot.x0 + 4, y - 14, plot.x0 + 4 + text_width(label, LABEL), y - 2)
    below = box[1] < plot.y0 + 2
    if below:
        box = (box[0], y + 2, box[2], y + 14)
    taken.append(box)
    return [f"<line x1='{plot.x0:.1f}' y1='{y:.1f}' x2='{plot.x0 + plot.w:.1f}' y2='{y:.1f}' "
            f"stroke='{LIMIT}' stroke-width='1.5' stroke-dasharray='6,4'/>",
            f"<text x='{box[0]:.1f}' y='{box[3] - 2:.1f}' font-size='{LABEL}' "
            f"fill='{LIMIT}'>{esc(label)}</text>"]


def _points(pts: Sequence[Point], plot: Plot, best: str, yfmt: Callable[[float], str],
            taken: list[Box]) -> list[str]:
    """Every point as a dot (frontier red, the winner ringed), labelled where there is room:
    the winner first, then the frontier, then the rest (all of them when few)."""
    front = set(frontier(pts))
    labelled = front if len(pts) > MAX_LABELS else set(pts)
    order = sorted(pts, key=lambda q: (q[2] != best, q not in front, q[0]))
    dots, labels = [], []
    for p in order:
        x, y = plot.xy(p[0], p[1])
        color, r = (FRONT, 5) if p in front else (OTHER, 3.5)
        ring = (f"<circle cx='{x:.1f}' cy='{y:.1f}' r='9' fill='none' stroke='#222' "
                f"stroke-width='1.5'/>" if p[2] == best else "")
        dots.append(f"{ring}<circle cx='{x:.1f}' cy='{y:.1f}' r='{r}' fill='{color}' "
                    f"stroke='#222' stroke-width='0.5'><title>{esc(p[2])}: time {num(p[0])}, "
                    f"memory {esc(yfmt(p[1]))}</title></circle>")
        text = f"winner: {p[2]}" if p[2] == best else p[2]
        spot = place_label(text, x, y, plot, taken) if p in labelled or p[2] == best else None
        if spot is not None:
            weight = "bold" if p[2] == best else "normal"
            labels.append(f"<text x='{spot[0]:.1f}' y='{spot[1]:.1f}' font-size='{LABEL}' "
                          f"text-anchor='{spot[2]}' font-weight='{weight}' "
                          f"fill='{'#222' if p in front else '#666'}'>{esc(text)}</text>")
    return list(reversed(dots)) + labels


def pareto(points: Sequence[Point], title: str = "time vs memory", width: int = 720,
           height: int = 480, xlabel: str = "iteration time (makespan)",
           ylabel: str = "peak memory", limit: float | None = None, best: str = "") -> str:
    """A standalone SVG scatter of ``points`` = [(time, memory, label)], the Pareto frontier
    highlighted; ``limit`` (a memory) is drawn as a dashed line and the point labelled ``best``
    ringed as the winner. An empty list draws empty axes with a note."""
    pts = _check(points)
    mems = [p[1] for p in pts] + ([limit] if limit is not None else [])
    yfmt = fmt_memory
    yr = _range(mems)
    x0 = 24.0 + max((text_width(yfmt(v), 10) for v in ticks(*yr, 5)), default=30.0)
    plot = Plot(x0, 48.0, width - x0 - 16.0, height - 108.0, _range([p[0] for p in pts]), yr)
    body = [f"<text x='8' y='20' font-size='15' font-weight='bold'>{esc(title)}</text>"]
    body += _axes(plot, xlabel, ylabel, yfmt)
    front = frontier(pts)
    if front:
        body.append(f"<path d='{_front_path(front, plot)}' fill='none' stroke='{FRONT}' "
                    f"stroke-width='1.5' stroke-dasharray='4,3'/>")
    taken: list[Box] = []
    if limit is not None:
        body += _limit_line(limit, plot, yfmt, taken)
    body += _points(pts, plot, best, yfmt, taken)
    if not pts:
        body.append(f"<text x='{x0 + plot.w / 2:.1f}' y='{plot.y0 + plot.h / 2}' "
                    f"text-anchor='middle'>no points</text>")
    note = f"{len(front)} of {len(pts)} points on the Pareto frontier (red)"
    if best:
        note += "; ringed: the winner"
    body.append(f"<text x='8' y='38' font-size='11' fill='#555'>{esc(note)}</text>")
    width = int(math.ceil(max(width, 8 + text_width(title, 15, bold=True) + 8,
                              8 + text_width(note, 11) + 8)))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' font-family='DejaVu Sans, Arial, sans-serif'>\n"
            f"<rect width='100%' height='100%' fill='#ffffff'/>\n" + "\n".join(body) + "\n</svg>\n")
