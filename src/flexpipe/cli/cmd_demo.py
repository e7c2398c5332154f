"""``flexpipe demo``: simulate every library schedule that builds at the demo size (p=4, m=8 with
default parameters) under unit costs, compare them with 1F1B, and draw the best one.

For now this is simulation only; the train-and-report demo will grow from here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rich.table import Table

from flexpipe.cli.common import console, positive_int
from flexpipe.errors import FlexPipeError
from flexpipe.sim.trace import Metrics, Trace
from flexpipe.viz.terminal import fmt

BASELINE = "1f1b"


@dataclass(frozen=True)
class Result:
    """One schedule's simulation at the demo size."""

    name: str
    trace: Trace
    metrics: Metrics

    @property
    def peak(self) -> float:
        """Worst rank's peak activation."""
        return max(self.metrics.peak_activation, default=0.0)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    parser = sub.add_parser("demo", help="compare the library schedules at p=4, m=8",
                            description="Simulate every library schedule that builds with its "
                            "default parameters, compare them with 1F1B and draw the best.")
    parser.add_argument("-p", "--ranks", type=positive_int, default=4, metavar="P",
                        help="pipeline ranks (default 4)")
    parser.add_argument("-m", "--microbatches", type=positive_int, default=8, metavar="M",
                        help="micro-batches (default 8)")
    parser.add_argument("--width", type=positive_int, metavar="N",
                        help="columns for the timeline (default: the terminal width)")
    parser.add_argument("--no-color", action="store_true", help="plain text timeline")


def simulate_library(p: int, m: int) -> tuple[list[Result], dict[str, str]]:
    """Every library schedule that builds and simulates at (p, m), and why the others did not."""
    from flexpipe.schedules.registry import build, names
    from flexpipe.sim.engine import simulate

    results, skipped = [], {}
    for name in names():
        try:
            trace = simulate(build(name, p, m))
        except FlexPipeError as exc:
            skipped[name] = str(exc).splitlines()[0]
            continue
        results.append(Result(name, trace, trace.metrics()))
    return results, skipped


def best(results: list[Result]) -> Result:
    """Shortest makespan; ties go to the lower peak activation, then the name."""
    return min(results, key=lambda r: (round(r.metrics.makespan, 9), r.peak, r.name))


def _ratio(x: float, base: float | None) -> str:
    return f"{x / base:.2f}x" if base else "-"


def comparison(results: list[Result], p: int, m: int) -> Table:
    """Bubble rate, makespan and peak activation, the last two also relative to 1F1B."""
    base = next((r for r in results if r.name == BASELINE), None)
    table = Table(title=f"library schedules at p={p}, m={m}, unit costs "
                  f"(relative to {BASELINE.upper()})", title_justify="left")
    for col, just in (("schedule", "left"), ("bubble rate", "right"), ("makespan", "right"),
                      ("vs 1F1B", "right"), ("peak act.", "right"), ("vs 1F1B ", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    base_time = base.metrics.makespan if base else None
    base_peak = base.peak if base else None
    for r in sorted(results, key=lambda r: (r.metrics.makespan, r.peak, r.name)):
        table.add_row(r.name, f"{r.metrics.bubble_rate:.4f}", fmt(r.metrics.makespan),
                      _ratio(r.metrics.makespan, base_time), fmt(r.peak),
                      _ratio(r.peak, base_peak))
    return table


def run(args: argparse.Namespace) -> int:
    """Simulate, compare, draw the best."""
    from flexpipe.cli.cmd_show import render

    results, skipped = simulate_library(args.ranks, args.microbatches)
    if not results:
        print(f"no library schedule builds at p={args.ranks}, m={args.microbatches}")
        return 1
    out = console(args.width)
    out.print(comparison(results, args.ranks, args.microbatches))
    for name, why in skipped.items():
        out.print(f"skipped {name}: {why}")
    top = best(results)
    out.print()
    render(top.trace, args.width, args.no_color, title=f"best: {top.name} (shortest makespan)")
    return 0
