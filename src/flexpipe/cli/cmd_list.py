"""``flexpipe list``: the library schedules, their extra parameters and a one-line summary; then
the ``torch:`` names (torch.distributed.pipelining's own orders) and the torch/torchtitan names
accepted as aliases."""

from __future__ import annotations

import argparse
import re

from rich.table import Table

from flexpipe.cli.common import console

SENTENCE_END = re.compile(r"(?<!\bal\.)(?<!e\.g\.)(?<!i\.e\.)(?<=[.!?])\s+(?=[A-Z])")


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``list`` subcommand."""
    parser = sub.add_parser("list", help="list the library schedules, their parameters and "
                            "the torch names",
                            description="List the library schedules, the parameters their "
                            "generators take beyond -p and -m, and what each one is; then "
                            "torch's schedule classes (torch:NAME) and the torch/torchtitan "
                            "names accepted as aliases.")
    parser.add_argument("--names", action="store_true", help="print the names only, one a line")
    parser.add_argument("--full", action="store_true", help="the whole summary paragraph")


def first_sentence(text: str) -> str:
    """The first sentence of ``text`` (up to a full stop followed by a capital or the end)."""
    return SENTENCE_END.split(text, maxsplit=1)[0]


def _params(params: tuple[tuple[str, object], ...]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params) or "-"


def run(args: argparse.Namespace) -> int:
    """Print the table (or the bare names)."""
    from flexpipe.schedules.registry import library

    entries = sorted(library().values(), key=lambda e: e.name)
    if args.names:
        print("\n".join(e.name for e in entries))
        return 0
    table = Table(title="library schedules (flexpipe show NAME -p P -m M)", title_justify="left")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("parameters", no_wrap=True)
    table.add_column("summary")
    for entry in entries:
        text = entry.summary if args.full else first_sentence(entry.summary)
        table.add_row(entry.name, _params(entry.params), text)
    out = console()
    out.print(table)
    out.print(_torch_table())
    return 0


def _torch_table() -> Table:
    """torch's classes: the ``torch:`` spec that reads torch's own order, and the alias (torch or
    torchtitan name) with the spec it runs."""
    from flexpipe.runtime.interop.torch_schedules import CLASSES
    from flexpipe.schedules.registry import ALIASES

    table = Table(title="torch / torchtitan names, also with torch's 'Schedule' prefix "
                  "(accepted wherever a schedule name is)", title_justify="left")
    table.add_column("alias", style="bold", no_wrap=True)
    table.add_column("runs", no_wrap=True)
    table.add_column("torch's own order", no_wrap=True)
    by_target = {cls.cls: f"torch:{name}" for name, cls in CLASSES.items()}
    for alias, target in ALIASES.items():
        cls = next((c for c in by_target if c.lower() == f"schedule{alias}"), "")
        table.add_row(_display(cls), target, by_target.get(cls, "-"))
    return table


def _display(cls: str) -> str:
    """torchtitan's spelling of a torch class: the class name without ``Schedule``."""
    return cls[len("Schedule"):] if cls.startswith("Schedule") else cls
