"""Colours, number formats and small geometry helpers shared by the SVG, HTML and PNG views.

An op's fill comes from its kind's registry entry (``OpKind.color``): a colour name as the
terminal view uses them (``blue``, ``bright_black``, ...) mapped to a softer web palette, or any
``#rrggbb`` / rich colour the kind declares, so new kinds draw with no edit here. Later chunks
(stages) on the same rank get a lighter tint of the kind colour.
"""

from __future__ import annotations

import math
from html import escape

from rich.color import Color, ColorParseError

from flexpipe.ir.kinds import OpKind
from flexpipe.ir.schedule import Schedule

WEB: dict[str, str] = {
    "black": "#3b3b3b", "red": "#d9534f", "green": "#4caf50", "yellow": "#f2c037",
    "blue": "#3f7fd0", "magenta": "#b05fc0", "cyan": "#2ab3b8", "white": "#d8d8d8",
    "bright_black": "#9a9a9a", "bright_red": "#f08a80", "bright_green": "#8fd694",
    "bright_yellow": "#f7dc7a", "bright_blue": "#8db9ee", "bright_magenta": "#e08be0",
    "bright_cyan": "#7fd8dc", "bright_white": "#f2f2f2",
}
FALLBACK = "#bbbbbb"
TINT = 0.55  # how far the last chunk on a rank is tinted towards white


def hex_rgb(color: str) -> tuple[int, int, int]:
    """``#rrggbb`` -> (r, g, b)."""
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def rgb_hex(rgb: tuple[float, float, float]) -> str:
    """(r, g, b) -> ``#rrggbb`` (components clamped to 0..255)."""
    return "#" + "".join(f"{max(0, min(255, round(c))):02x}" for c in rgb)


def base_color(name: str) -> str:
    """A kind's declared colour as ``#rrggbb``: the web palette, else whatever rich parses."""
    if name in WEB:
        return WEB[name]
    try:
        return rgb_hex(tuple(Color.parse(name).get_truecolor()))  # type: ignore[arg-type]
    except ColorParseError:
        return FALLBACK


def tint(color: str, amount: float) -> str:
    """``color`` moved ``amount`` (0..1) of the way to white."""
    return rgb_hex(tuple(c + (255 - c) * amount for c in hex_rgb(color)))  # type: ignore[arg-type]


def fill(kind: OpKind, chunk: int = 0, chunks: int = 1) -> str:
    """The fill of an op of ``kind`` on the ``chunk``-th of ``chunks`` stages of its rank."""
    base = base_color(kind.color)
    if chunks < 2 or chunk == 0:
        return base
    return tint(base, TINT * chunk / (chunks - 1))


def ink(background: str) -> str:
    """Black or white text, whichever reads better on ``background``."""
    r, g, b = hex_rgb(background)
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "#ffffff"


def chunk_of(schedule: Schedule) -> dict[int, tuple[int, int]]:
    """stage -> (index of the stage among its rank's stages, stages on that rank)."""
    out = {}
    for stages in schedule.placement.rank_stages:
        for i, s in enumerate(stages):
            out[s] = (i, len(stages))
    return out


def nice_step(span: float, ticks: int) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving about ``ticks`` ticks over ``span``."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(ticks, 1)
    mag = 10 ** math.floor(math.log10(raw))
    return next(k * mag for k in (1, 2, 5, 10) if k * mag >= raw * (1 - 1e-9))


def ticks(lo: float, hi: float, count: int) -> list[float]:
    """Round tick values from ``lo`` to ``hi`` (inclusive when ``hi`` is on a tick)."""
    step = nice_step(hi - lo, count)
    first = math.ceil(lo / step - 1e-9) * step
    n = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [round(first + k * step, 12) for k in range(max(n, 0))]


def text_width(s: str, size: float, bold: bool = False) -> float:
    """An upper estimate of the width in pixels of ``s`` at font ``size`` (DejaVu Sans, the
    widest of the fonts the pictures ask for: about 0.6 em per character, bold wider)."""
    return len(s) * size * (0.72 if bold else 0.64)


def num(x: float) -> str:
    """A number for labels: up to 4 significant digits, no trailing zeros."""
    return f"{x:.4g}"


def esc(text: object) -> str:
    """Text escaped for SVG/HTML content and attribute values."""
    return escape(str(text), quote=True)
