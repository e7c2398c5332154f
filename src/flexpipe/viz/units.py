"""Human units for every view (terminal, HTML, SVG): bytes in KiB/MiB/GiB, times in ms.

A cost model's memory is in bytes (profiled models, the transformer formulas, planner inputs)
or in units of one micro-batch's activation M_B (unit-cost studies: 1, 2, 4, ...). ``fmt_memory``
tells them apart by size: 1024 or more is bytes (no schedule holds a thousand micro-batches'
activations on one rank in M_B units), smaller is a count of M_B."""

from __future__ import annotations

import math

BINARY = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
BYTES_FROM = 1024.0
"""Memory values from this size up are bytes; below it, M_B units."""


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
    """A cost-model memory figure: bytes with a binary unit, or a count of M_B."""
    return fmt_bytes(value) if is_bytes(value) else f"{value:.4g}"


def fmt_time(value: float, unit: str = "") -> str:
    """A simulated time in the cost model's unit (``ms`` for profiled and paper costs, none for
    unit costs), up to 4 significant digits."""
    return f"{value:.4g} {unit}".rstrip() if abs(value) < 1e4 else f"{value:,.0f} {unit}".rstrip()
