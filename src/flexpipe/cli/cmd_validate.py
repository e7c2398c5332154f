"""``flexpipe validate``: check a schedule against every rule; print "valid" (exit 0) or every
violation (exit 1). Input that cannot be read at all (bad file, bad text) exits 2."""

from __future__ import annotations

import argparse

from flexpipe.cli.common import (
    add_cost_arg,
    add_mem_arg,
    add_schedule_args,
    schedule_and_cost,
)
from flexpipe.sim.validate import validate

EXIT_INVALID = 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``validate`` subcommand."""
    parser = sub.add_parser("validate", help="check a schedule and list its violations",
                            description="Check a schedule file (or a library schedule) for "
                            "missing or duplicated ops, broken dependencies, deadlocks and, "
                            "with --mem, memory over the limit.")
    add_schedule_args(parser, spec_help="schedule file (or a library name with -p and -m)",
                      gate=False)
    add_cost_arg(parser)
    add_mem_arg(parser, "report every rank whose simulated peak memory exceeds LIMIT")


def run(args: argparse.Namespace) -> int:
    """Validate and report."""
    schedule, cost = schedule_and_cost(args)
    violations = validate(schedule, cost=cost, mem_limit=args.mem)
    if not violations:
        print("valid")
        return 0
    count = len(violations)
    print(f"invalid: {count} violation{'s' if count != 1 else ''}")
    for v in violations:
        print("  " + str(v).replace("\n", "\n    "))
    return EXIT_INVALID
