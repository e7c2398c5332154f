"""``flexpipe export``: write a schedule in one of the interchange formats (FlexPipe text, or the
compute-only CSV of torch.distributed.pipelining) to stdout or a file."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from flexpipe.cli import guards
from flexpipe.cli.common import add_schedule_args, load_schedule
from flexpipe.cli.written import announce
from flexpipe.ir.schedule import Schedule
from flexpipe.ir.torch_csv import to_torch_csv


def _text(schedule: Schedule) -> str:
    return schedule.to_text()


def _torch_csv(schedule: Schedule) -> str:
    text: str = to_torch_csv(schedule)
    return text


FORMATS: dict[str, Callable[[Schedule], str]] = {"text": _text, "torch-csv": _torch_csv}


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` subcommand."""
    parser = sub.add_parser("export", help="write a schedule as text or torch CSV",
                            description="Write a schedule in FlexPipe's text format or as "
                            "torch.distributed.pipelining's compute-only CSV.")
    add_schedule_args(parser)
    parser.add_argument("--format", choices=sorted(FORMATS), default="text",
                        help="output format (default: text)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write here instead of stdout")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the output file if it exists")


def run(args: argparse.Namespace) -> int:
    """Convert and write."""
    guards.check_output(args.output, args.force)
    text = FORMATS[args.format](load_schedule(args))
    if args.output is None:
        print(text, end="" if text.endswith("\n") else "\n")
        return 0
    guards.write_text(args.output, text)
    announce(args.output, f"the schedule, as {args.format}", to_stderr=True)
    return 0
