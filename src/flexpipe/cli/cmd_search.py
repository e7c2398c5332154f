"""``flexpipe search``: find the fastest schedule for a cost model, p ranks, m micro-batches and a
per-rank memory limit; print the winner, the Pareto frontier and every candidate tried."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexpipe.cli import guards
from flexpipe.cli.common import (
    add_cost_arg,
    add_guard_arg,
    console,
    positive_int,
    positive_number,
    require,
)
from flexpipe.cli.config import add_config_arg
from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.search.result import SearchResult, Trial
from flexpipe.viz.units import fmt_memory


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``search`` subcommand."""
    parser = sub.add_parser("search", help="find the best schedule under a memory limit",
                            description="Search the library families and list-scheduler "
                            "synthesis (optionally CP-SAT) for the fastest schedule whose peak "
                            "activation fits the limit on every rank.")
    add_cost_arg(parser)
    parser.add_argument("-p", "--ranks", type=positive_int, required=True, metavar="P",
                        help="pipeline ranks (devices)")
    parser.add_argument("-m", "--microbatches", type=positive_int, metavar="M",
                        help="micro-batches per iteration (required without --preset; with it, "
                        "defaults to 3P)")
    parser.add_argument("--mem", type=_limits, metavar="LIMIT",
                        help="activation memory limit per rank in the cost model's act units "
                        "(M_B); one number, or one per rank separated by commas (required "
                        "without --preset; with it, defaults to the chain-1F1B baseline's peak)")
    parser.add_argument("--preset", metavar="NAME",
                        help="search a model that is not a chain (clip, encdec, "
                        "gpt-sharded-vocab; Tessel's tessel-v, -m, -x, -nn) over all its "
                        "layouts on P devices")
    parser.add_argument("--exact", action="store_true",
                        help="improve the best schedule with the CP-SAT optimiser; a proof "
                        "covers only the best's placement and split mode (the output says)")
    parser.add_argument("--exact-placements", action="store_true",
                        help="also solve every placement searched exactly, to prove "
                        "optimality across them (small p x m only)")
    parser.add_argument("--time-limit", type=positive_number, default=10.0, metavar="S",
                        help="seconds for the exact optimiser (default 10)")
    parser.add_argument("--objective", choices=("span", "makespan"), default="span",
                        help="rank by the largest per-rank span (bubble rate) or makespan")
    add_config_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the best schedule as text (loadable by every command)")
    parser.add_argument("--all", action="store_true", help="list every candidate tried")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the output file if it exists")
    add_guard_arg(parser)


def _limits(text: str) -> float | list[float]:
    parts = [positive_number(x.strip()) for x in text.split(",")]
    return parts[0] if len(parts) == 1 else parts


def _cost(args: argparse.Namespace) -> CostModel | None:
    if args.cost is None:
        return None
    if not os.path.isfile(args.cost):
        raise ConfigError(f"cost file {args.cost!r} does not exist")
    io = require("flexpipe.cost.io", "cost files")
    return io.load_cost(args.cost)


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[int, int, str], None] | None]:
    """A rich progress bar on stderr, or None when stderr is not a terminal."""
    if not enabled:
        yield None
        return
    bar = Progress(TextColumn("searching"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.description}"), TimeElapsedColumn(),
                   console=Console(file=sys.stderr), transient=True)
    task = bar.add_task("", total=None)
    with bar:
        yield lambda done, total, label: bar.update(task, completed=done, total=total,
                                                    description=label)


def run(args: argparse.Namespace) -> int:
    """Search and print."""
    from flexpipe.search.engine import search

    if args.preset is not None and args.cost is not None:
        raise ConfigError("give --preset or --cost, not both (a preset brings its cost model)")
    if args.preset is None and (args.mem is None or args.microbatches is None):
        raise ConfigError("-m and --mem are required (or search a --preset)")
    if args.microbatches is None:
        args.microbatches = 3 * args.ranks
    guards.check_output(args.output, args.force)
    guards.check_ops(6 * args.ranks * args.microbatches,
                     f"a search at p={args.ranks}, m={args.microbatches}", args.no_size_guard)
    with _progress(sys.stderr.isatty() and not args.json) as progress:
        if args.preset is not None:
            result = _search_preset(args, progress)
        else:
            result = search(_cost(args), args.ranks, args.microbatches, args.mem,
                            exact=args.exact, time_limit=args.time_limit, progress=progress,
                            objective=args.objective, exact_placements=args.exact_placements)
    if args.output and result.best is not None:
        guards.write_text(args.output, result.best.to_text() + "\n")
    if args.json:
        print(guards.dumps(result.as_dict()))
    else:
        _print(result, args.all)
    return 0 if result.best is not None else 1


def _search_preset(args: argparse.Namespace,
                   progress: Callable[[int, int, str], None] | None) -> SearchResult:
    """Search every layout of ``--preset``; prints the chain-1F1B baseline first."""
    from flexpipe.graphs import chain_baseline, preset_layouts
    from flexpipe.search.graphs import search_graph
    from flexpipe.sim.engine import simulate

    models = preset_layouts(args.preset, args.ranks)
    result = search_graph(models, args.microbatches, args.mem, exact=args.exact,
                          time_limit=args.time_limit, progress=progress,
                          objective=args.objective)
    if not args.json:
        base = simulate(*chain_baseline(models[0], args.microbatches)).metrics()
        best = result.best_trial
        speed = (f", best is {base.makespan / best.makespan:.3f}x faster"
                 if best is not None and best.makespan else "")
        console().print(f"chain-only 1F1B baseline: makespan {base.makespan:.6g}, bubble rate "
                        f"{base.bubble_rate:.4f}, peak activation "
                        f"{fmt_memory(max(base.peak_activation))}{speed}")
    return result


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _mem(value: float | None) -> str:
    return "-" if value is None else fmt_memory(value)


def _table(title: str, trials: list[Trial]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("candidate", "placement", "status", "span", "bubble", "peak", "why"):
        table.add_column(col, justify="right" if col in ("span", "bubble", "peak") else "left")
    for t in trials:
        table.add_row(t.label, t.placement, t.status, _fmt(t.span), _fmt(t.bubble_rate, ".4f"),
                      _mem(t.peak), t.reason)
    return table


def _print(result: SearchResult, show_all: bool) -> None:
    out = console()
    best = result.best_trial
    if best is None:
        out.print("no candidate fits the memory limit")
    else:
        out.print(f"best: {best.label} ({best.placement}): span {best.span:.6g}, bubble rate "
                  f"{best.bubble_rate:.4f}, peak activation {_mem(best.peak)}")
    gap = result.gap
    out.print(f"lower bound {result.lower_bound:.6g}" + (f", gap {gap:.2%}" if gap is not None
                                                          else "")
              + f"; {len(result.trials)} candidates in {result.seconds:.2f} s "
              + ", ".join(f"{k}: {v}" for k, v in result.counts().items()))
    if result.exact:
        ex = result.exact
        out.print(f"exact (CP-SAT): {ex['status']}, objective {_fmt(ex['objective'])}, "  # type: ignore[arg-type]
                  f"bound {_fmt(ex['bound'])}")  # type: ignore[arg-type]
        for key in ("claim", "across_claim"):
            if key in ex:
                out.print(f"  {ex[key]}")
    out.print(_table("Pareto frontier (span vs peak activation)", result.frontier))
    shown = result.trials if show_all else [t for t in result.trials
                                            if t.status in ("best", "slower", "over memory")]
    out.print(_table("candidates" + ("" if show_all else " simulated (--all for every one)"),
                     shown))
