"""``flexpipe search``: find the fastest schedule for a cost model, p ranks, m micro-batches and a
per-rank memory limit; print the winner, the Pareto frontier and every candidate tried."""

from __future__ import annotations

import argparse
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
    add_mem_arg,
    console,
    positive_int,
    positive_number,
    read_cost,
)
from flexpipe.cli.config import add_config_arg
from flexpipe.cli.written import announce
from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.search.result import SearchResult, Trial
from flexpipe.viz.units import (
    MS,
    Units,
    bubble_definition,
    fmt_memory,
    fmt_time,
    memory_note,
    units_for,
)

BUBBLE_NOTE = ("1 - useful work / (ranks x largest rank span): the zero-bubble paper's "
               "(docs/facts.md) when every rank does the same work, the general one for uneven "
               "stages otherwise (docs/architecture.md)")


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
    add_mem_arg(parser, "the peak activation every rank must fit (required without --preset; "
                "with it, defaults to the chain-1F1B baseline's peak)")
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
    parser.add_argument("--objective", choices=("span", "makespan"), default="makespan",
                        help="rank by the largest per-rank span (bubble rate) or makespan")
    parser.add_argument("--no-recompute", action="store_true",
                        help="do not try the library schedules that do not fit with selective "
                        "(SR) or full (R) recompute on the stages that need it")
    add_config_arg(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("-o", "--output", metavar="FILE",
                        help="write the best schedule as text (loadable by every command)")
    parser.add_argument("--all", action="store_true", help="list every candidate tried")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the output file if it exists")
    add_guard_arg(parser)


def _cost(args: argparse.Namespace) -> CostModel | None:
    return None if args.cost is None else read_cost(args.cost)


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
                            objective=args.objective, exact_placements=args.exact_placements,
                            recompute=not args.no_recompute)
    if args.output and result.best is not None:
        guards.write_text(args.output, result.best.to_text() + "\n")
        announce(args.output, "the best schedule, as text", args.json)
    if args.json:
        print(guards.dumps(as_json(result)))
    else:
        _print(result, args.all, units_for(args.cost or args.preset))
    return 0 if result.best is not None else 1


def as_json(result: SearchResult) -> dict[str, object]:
    """``result.as_dict()`` with the recompute line the text output prints, if any."""
    data = result.as_dict()
    best = result.best_trial
    if best is not None and best.recompute is not None:
        data["recompute"] = {**best.recompute.as_dict(), "line": best.recompute.line(fmt_memory)}
    return data


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
        console().print(f"chain-only 1F1B baseline: makespan {fmt_time(base.makespan, MS)}, "
                        f"bubble rate {base.bubble_rate:.4f}, peak activation "
                        f"{fmt_memory(max(base.peak_activation))}{speed}")
    return result


def nothing_fits(result: SearchResult) -> str:
    """Why there is no answer: the limit, and the smallest peak any candidate reached
    (recompute variants included, when the search tried them)."""
    limits = sorted(set(result.limits))
    text = f"no candidate fits the memory limit ({', '.join(map(fmt_memory, limits))} per rank)"
    least = result.least_peak
    if least is None or least.peak is None:
        return text
    tried = any(t.recompute is not None for t in result.trials)
    return (f"{text}{', even with recompute' if tried else ''}: the smallest peak reached is "
            f"{fmt_memory(least.peak)} ({least.label})")


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _mem(value: float | None) -> str:
    return "-" if value is None else fmt_memory(value)


def frontier_why(trial: Trial, best: Trial | None, units: Units) -> str:
    """Why a frontier row is there: its span and memory against the printed best's."""
    if best is None or trial is best or trial.span is None or best.span is None:
        return "the best" if trial is best else trial.reason
    slower = f"{100 * (trial.span / best.span - 1):+.1f}% span"
    if trial.peak is None or best.peak is None or not best.peak:
        return f"{slower} vs the best ({fmt_time(best.span, units)})"
    return (f"{slower}, {100 * (trial.peak / best.peak - 1):+.1f}% memory vs the best "
            f"({fmt_time(best.span, units)}, {fmt_memory(best.peak)})")


def candidate_why(trial: Trial, best: Trial | None, units: Units) -> str:
    """A candidate's reason; a slower one is compared with the printed best (the search's own
    reason compares it with the best known when it was tried, which may differ)."""
    if trial.status != "slower" or best is None or trial.span is None or best.span is None:
        return trial.reason
    return (f"span {fmt_time(trial.span, units)} vs best {fmt_time(best.span, units)} "
            f"({100 * (trial.span / best.span - 1):+.1f}%)")


def _table(title: str, trials: list[Trial], units: Units,
           why: Callable[[Trial], str]) -> Table:
    table = Table(title=title, title_justify="left")
    heads = ("candidate", "placement", "status", f"span ({units.time})", "bubble", "peak", "why")
    for col in heads:
        table.add_column(col, justify="left" if col in ("candidate", "placement", "status",
                                                          "why") else "right")
    for t in trials:
        table.add_row(t.label, t.placement, t.status, _fmt(t.span), _fmt(t.bubble_rate, ".4f"),
                      _mem(t.peak), why(t))
    return table


def _print(result: SearchResult, show_all: bool, units: Units) -> None:
    out = console()
    best = result.best_trial
    if best is None:
        out.print(nothing_fits(result), markup=False, soft_wrap=True)
    else:
        out.print(f"best: {best.label} ({best.placement}): span "
                  f"{fmt_time(best.span or 0.0, units)} (largest rank span), bubble rate "
                  f"{best.bubble_rate:.4f}, peak activation {_mem(best.peak)}")
        if best.recompute is not None:
            out.print(best.recompute.line(fmt_memory), markup=False, soft_wrap=True)  # one line
    gap = result.gap
    out.print(f"lower bound {fmt_time(result.lower_bound, units)}"
              + (f", gap {gap:.2%}" if gap is not None else "")
              + f"; {len(result.trials)} candidates in {result.seconds:.2f} s "
              + ", ".join(f"{k}: {v}" for k, v in result.counts().items()))
    peak = best.peak if best is not None and best.peak is not None else 0.0
    out.print(f"units: {units.note}; {memory_note(peak)}")
    useful = best.metrics.useful if best is not None and best.metrics is not None else None
    out.print(f"bubble rate: {BUBBLE_NOTE if useful is None else bubble_definition(useful)}")
    if result.exact:
        ex = result.exact
        out.print(f"exact (CP-SAT): {ex['status']}, objective {_fmt(ex['objective'])}, "  # type: ignore[arg-type]
                  f"bound {_fmt(ex['bound'])}")  # type: ignore[arg-type]
        for key in ("claim", "across_claim"):
            if key in ex:
                out.print(f"  {ex[key]}")
    out.print(_table("Pareto frontier (span vs peak activation)", result.frontier, units,
                     lambda t: frontier_why(t, best, units)))
    shown = result.trials if show_all else [t for t in result.trials
                                            if t.status in ("best", "slower", "over memory")]
    out.print(_table("candidates" + ("" if show_all else " simulated (--all for every one)"),
                     shown, units, lambda t: candidate_why(t, best, units)))
