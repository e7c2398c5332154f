"""``flexpipe simulate``: simulate a schedule and print its metrics, as a table or as JSON."""

from __future__ import annotations

import argparse

from flexpipe.cli import guards
from flexpipe.cli.common import add_cost_arg, add_schedule_args, console, describe, simulate_args
from flexpipe.sim.trace import Trace


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` subcommand."""
    parser = sub.add_parser("simulate", help="simulate a schedule and print its metrics",
                            description="Simulate a schedule under a cost model (unit costs by "
                            "default) and print makespan, bubble rate and per-rank memory.")
    add_schedule_args(parser)
    add_cost_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def report(trace: Trace, cost: str | None = None) -> dict[str, object]:
    """The JSON-ready result: schedule identity, the metrics and per-rank lists."""
    from flexpipe.viz.units import bubble_definition, is_bytes

    schedule = trace.schedule
    metrics = trace.metrics()
    memory = "bytes" if is_bytes(max(metrics.peak_memory, default=0.0)) else "M_B"
    return {
        "schedule": schedule.name, "p": schedule.num_ranks, "m": schedule.microbatches,
        "stages": schedule.num_stages, "ops": len(schedule), "cost": cost or "unit",
        "units": {"time": "ms (the cost model's unit)" if cost
                  else "unit costs (F = B = W = 1 per rank)", "memory": memory,
                  "bubble_rate": bubble_definition(trace.metrics().useful)},
        **metrics.as_dict(),
    }


def run(args: argparse.Namespace) -> int:
    """Simulate and print."""
    from flexpipe.viz.terminal import metrics_table, summary
    from flexpipe.viz.units import units_for

    trace = simulate_args(args)
    if args.json:
        print(guards.dumps(report(trace, args.cost)))
        return 0
    metrics = trace.metrics()
    out = console()
    out.print(describe(trace.schedule))
    units = units_for(args.cost)
    out.print(summary(metrics, units))
    out.print(metrics_table(metrics, units=units))
    return 0
