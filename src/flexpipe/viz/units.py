"""Human units for every view (terminal, HTML, SVG): bytes in KiB/MiB/GiB, times in ms or in
unit-cost passes, memory counts in M_B, and which bubble-rate definition a figure follows.

A cost model's memory is in bytes (profiled models, the transformer formulas, planner inputs)
or in units of one micro-batch's activation M_B (unit-cost studies and cost files such as
examples/my_cost.toml: 1, 2, 4, ...). ``fmt_memory`` tells them apart by size: 1024 or more is
bytes (no schedule holds a thousand micro-batches' activations on one rank in M_B units),
smaller is a count of M_B.

A cost model's time is in ms when it comes from a cost file, a profile or a preset (the papers'
tables and docs/cost.md use ms), and in unit-cost passes without one (F = B = W = 1 per rank):
``Units`` names which, once per view, and ``fmt_time`` writes a figure with it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
BYTES_FROM = 1024.0
"""Memory values from this size up are bytes; below it, M_B units."""
M_B = "M_B"


@dataclass(frozen=True)
class Units:
    """How a view labels time: ``time`` is the suffix of every time figure (``ms``, or
    ``units`` at unit costs), ``axis`` the time axis's title, ``note`` what a time unit is."""

    time: str
    axis: str
    note: str


UNIT_COST = Units("units", "time (unit cost: F = B = W = 1 per rank)",
                  "unit cost, F = B = W = 1 per rank (a time of 1 is one rank's forward pass)")
MS = Units("ms", "time (ms)", "times in ms (the cost model's unit)")


def memory_note(value: float) -> str:
    """What a memory figure like ``value`` is measured in."""
    return ("memory in bytes" if is_bytes(value) else
            "memory in M_B (one micro-batch's activation on one stage)")


def units_for(cost: object) -> Units:
    """The units of a run: ``MS`` when a cost model (file, profile, preset) is given, else
    ``UNIT_COST``."""
    return MS if cost else UNIT_COST


def fmt_bytes(n: float) -> str:
    """``n`` bytes with a binary unit: ``512 B``, ``1.5 KiB``, ``412.0 MiB``, ``5.26 GiB``."""
    if not math.isfinite(n):
        return str(n)
    x, unit = float(n), 0
    while abs(x) >= 1023.95 and unit < len(BINARY) - 1:  # 1023.96 KiB reads 1.00 MiB
        x /= 1024
        unit += 1
    if unit == 0:
        return f"{x:.0f} B"
    return f"{x:.2f} {BINARY[unit]}" if abs(x) < 10 else f"{x:.1f} {BINARY[unit]}"


def fmt_ms(ms: float) -> str:
    """A time in milliseconds: ``0.412 ms``, ``12.3 ms``, ``1,234 ms``."""
    if not math.isfinite(ms):
        return f"{ms} ms"
    if abs(ms) >= 1000:
        return f"{ms:,.0f} ms"
    return f"{ms:.3g} ms" if abs(ms) < 10 else f"{ms:.1f} ms"


def is_bytes(value: float) -> bool:
    """Whether a cost-model memory figure is in bytes (see the module docstring)."""
    return abs(value) >= BYTES_FROM


def fmt_memory(value: float) -> str:
    """A cost-model memory figure: bytes with a binary unit, or a count of M_B (``4 M_B``)."""
    return fmt_bytes(value) if is_bytes(value) else f"{value:.4g} {M_B}"


def fmt_time(value: float, units: Units | str = "") -> str:
    """A simulated time with its unit (``1736 ms``, ``27 units``), up to 4 significant digits
    (thousands separated from 10,000 up)."""
    unit = units.time if isinstance(units, Units) else units
    text = f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return f"{text} {unit}".rstrip()


def equal_work(useful: Sequence[float]) -> bool:
    """Whether every rank does the same useful work (to 0.1%)."""
    return not useful or max(useful) - min(useful) <= 1e-3 * max(max(useful), 1e-12)


def bubble_definition(useful: Sequence[float]) -> str:
    """Which bubble rate a trace's figure is, from its ranks' useful work (``bubble_note``)."""
    return bubble_note(equal_work(useful))


def bubble_note(even: bool) -> str:
    """Which bubble rate the figures are: the zero-bubble paper's (docs/facts.md) when every rank
    does the same work (``even``), else the general one for uneven stages
    (docs/architecture.md)."""
    if even:
        return "the zero-bubble paper's (docs/facts.md; every rank does the same work)"
    return ("1 - useful work / (ranks x largest span), for uneven stages "
            "(docs/architecture.md): ranks do unequal work, so not the paper's")
