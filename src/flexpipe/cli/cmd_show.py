"""``flexpipe show``: draw a simulated schedule as a timeline in the terminal, with its metrics."""

from __future__ import annotations

import argparse

from flexpipe.cli.common import (
    add_cost_arg,
    add_schedule_args,
    console,
    describe,
    positive_int,
    simulate_args,
    use_color,
)
from flexpipe.sim.trace import Trace
from flexpipe.viz.units import UNIT_COST, Units, units_for


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``show`` subcommand."""
    parser = sub.add_parser("show", help="draw a simulated schedule as a terminal timeline",
                            description="Simulate a schedule and draw it: one row per rank, "
                            "each op a cell labelled with its micro-batch, then the metrics.")
    add_schedule_args(parser)
    add_cost_arg(parser)
    parser.add_argument("--width", type=positive_int, metavar="N",
                        help="columns to draw in (default: the terminal width)")
    parser.add_argument("--no-color", action="store_true",
                        help="plain text glyphs even on a colour terminal (also: NO_COLOR=1)")
    parser.add_argument("--compact", action="store_true",
                        help="always wrap the timeline into bands scaled so that the shortest "
                        "op holds its label (the default whenever one band at this width "
                        "would squeeze cells together)")


def render(trace: Trace, width: int | None = None, no_color: bool = False,
           title: str | None = None, compact: bool = False,
           units: Units = UNIT_COST) -> None:
    """Print the header line, timeline, summary and per-rank metrics of ``trace``; the timeline
    wraps into readable bands when ``compact`` or when one band at this width would squeeze
    the shortest op below its label."""
    from flexpipe.viz.terminal import (
        compact_timeline,
        metrics_table,
        needs_compact,
        summary,
        timeline,
    )

    out = console(width)
    metrics = trace.metrics()
    color = use_color(out, no_color)
    out.print(title or describe(trace.schedule))
    wrap = compact or needs_compact(trace, out.width, color)
    draw = compact_timeline if wrap else timeline
    out.print(draw(trace, out.width, color, units=units))
    out.print(summary(metrics, units))
    out.print(metrics_table(metrics, units=units))


def run(args: argparse.Namespace) -> int:
    """Simulate and draw."""
    render(simulate_args(args), args.width, args.no_color, compact=args.compact,
           units=units_for(args.cost))
    return 0
