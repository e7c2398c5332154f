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
                        help="keep every op's label readable at any width: scale time so the "
                        "shortest op holds its label and wrap the timeline into bands (V-shape "
                        "and interleaved schedules at 80 columns)")


def render(trace: Trace, width: int | None = None, no_color: bool = False,
           title: str | None = None, compact: bool = False) -> None:
    """Print the header line, timeline (``compact``: wrapped into readable bands), summary and
    per-rank metrics of ``trace``."""
    from flexpipe.viz.terminal import compact_timeline, metrics_table, summary, timeline

    out = console(width)
    metrics = trace.metrics()
    out.print(title or describe(trace.schedule))
    draw = compact_timeline if compact else timeline
    out.print(draw(trace, out.width, use_color(out, no_color)))
    out.print(summary(metrics))
    out.print(metrics_table(metrics))


def run(args: argparse.Namespace) -> int:
    """Simulate and draw."""
    render(simulate_args(args), args.width, args.no_color, compact=args.compact)
    return 0
