"""``flexpipe demo``: the main job. Profile the built-in GPT on 2 local ranks, search the best
schedule under a memory limit, compare it with 1F1B, ZB-H1, ZB-V and the V family, train a few
dozen steps with it and write an HTML report (flexpipe.demo). ``--dry-run`` only simulates the
library at unit costs, compares with 1F1B and draws the best (no torch needed)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexpipe.cli.common import console, positive_int
from flexpipe.errors import ConfigError, FlexPipeError
from flexpipe.sim.trace import Metrics, Trace
from flexpipe.viz.terminal import fmt
from flexpipe.viz.units import fmt_memory

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
    parser = sub.add_parser("demo", help="profile, search, train and report on the built-in GPT",
                            description="Profile the built-in GPT on local ranks, search the "
                            "best schedule under a memory limit, compare it with the library, "
                            "train with it and write an HTML report.")
    parser.add_argument("-p", "--ranks", type=positive_int, default=None, metavar="P",
                        help="pipeline ranks (default 2; 4 with --dry-run)")
    parser.add_argument("-m", "--microbatches", type=positive_int, default=8, metavar="M",
                        help="micro-batches (default 8)")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps (30)")
    parser.add_argument("--mem-fraction", type=float, default=0.75,
                        help="memory limit as a fraction of 1F1B's peak (default 0.75)")
    parser.add_argument("--out", default="flexpipe-demo", help="report folder")
    parser.add_argument("--dry-run", action="store_true",
                        help="only simulate the library at unit costs and draw the best")
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


def _speedup(x: float, base: float | None) -> str:
    """1F1B's makespan / this one's (above 1 is faster), the demo's one ratio of speed."""
    return f"{base / x:.2f}x" if base and x else "-"


def comparison(results: list[Result], p: int, m: int) -> Table:
    """Bubble rate, makespan and peak activation, with the speed-up over 1F1B and the peak
    relative to 1F1B's."""
    base = next((r for r in results if r.name == BASELINE), None)
    table = Table(title=f"library schedules at p={p}, m={m}, unit costs (F = B = W = 1 per "
                  f"rank; memory in M_B)", title_justify="left")
    for col, just in (("schedule", "left"), ("bubble rate", "right"),
                      ("makespan (units)", "right"), ("speed-up vs 1F1B", "right"),
                      ("peak act.", "right"), ("memory vs 1F1B", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]
    base_time = base.metrics.makespan if base else None
    base_peak = base.peak if base else None
    for r in sorted(results, key=lambda r: (r.metrics.makespan, r.peak, r.name)):
        table.add_row(r.name, f"{r.metrics.bubble_rate:.4f}", fmt(r.metrics.makespan),
                      _speedup(r.metrics.makespan, base_time), fmt_memory(r.peak),
                      _ratio(r.peak, base_peak))
    return table


def run(args: argparse.Namespace) -> int:
    """The main job, or with ``--dry-run`` the unit-cost comparison."""
    return (_dry_run if args.dry_run else _main_job)(args)


def _dry_run(args: argparse.Namespace) -> int:
    """Simulate, compare, draw the best."""
    from flexpipe.cli.cmd_show import render

    p = args.ranks or 4
    results, skipped = simulate_library(p, args.microbatches)
    if not results:
        print(f"no library schedule builds at p={p}, m={args.microbatches}")
        return 1
    out = console(args.width)
    out.print(comparison(results, p, args.microbatches))
    for name, why in skipped.items():
        out.print(f"skipped {name}: {why}")
    top = best(results)
    out.print()
    render(top.trace, args.width, args.no_color, title=f"best: {top.name} (shortest makespan)")
    return 0


def _main_job(args: argparse.Namespace) -> int:
    """Profile, search, compare, train, report."""
    from pathlib import Path

    from flexpipe.cost.io import save_cost
    from flexpipe.demo import DemoConfig, run_demo
    from flexpipe.demo.report import write_report

    if not 0 < args.mem_fraction <= 4:
        raise ConfigError(f"--mem-fraction must be in (0, 4], got {args.mem_fraction}")
    _check_out(args.out)
    cfg = DemoConfig(ranks=args.ranks or 2, microbatches=args.microbatches, steps=args.steps,
                     mem_fraction=args.mem_fraction, out=args.out)
    out = console(args.width)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=out, transient=False) as bar:
        task = bar.add_task("demo", total=5)

        def say(what: str) -> None:
            bar.update(task, description=what, advance=0 if what.startswith("profiling") else 1)

        result = run_demo(cfg, say)
        bar.update(task, description="done", completed=5)
    out.print(_story_grid(result))
    out.print(_result_table(result))
    losses = result.losses
    if losses:
        out.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps  "
                  f"{_spark(losses)}")
    folder = Path(cfg.out)
    folder.mkdir(parents=True, exist_ok=True)
    save_cost(result.cost, folder / "cost.json")
    report = write_report(result, folder / "report.html")
    out.print(f"report: {report}   profiled costs: {folder / 'cost.json'}")
    return 0


def _check_out(folder: str) -> None:
    """Before the work: the report folder exists (made if needed) and its report.html and
    cost.json can be written (the demo's own files: replaced when there)."""
    from pathlib import Path

    from flexpipe.cli import guards

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--out {folder!r}: cannot make the report folder "
                          f"({getattr(exc, 'strerror', None) or exc})") from None
    for name in ("report.html", "cost.json"):
        guards.check_output(str(Path(folder) / name), force=True)


def _story_grid(result: Any) -> Table:
    """The verdict first: asked, found, memory, speed, why (``flexpipe.demo.story``)."""
    from flexpipe.demo.story import story

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, text in story(result):
        grid.add_row(label, escape(text))
    return grid


def _result_table(result: Any) -> Table:
    """Every compared schedule with the profiled costs, readable names unbroken."""
    from flexpipe.demo.report import comparison_rows

    rows, best_row = comparison_rows(result)
    table = Table(title=f"predicted with the profiled costs (ms); memory limit "
                  f"{fmt_memory(result.limit)} of activations per rank", title_justify="left")
    for col in ("schedule", "step (ms)", "bubble", "peak act.", "fits", "vs 1F1B"):
        table.add_column(col, justify="left" if col == "schedule" else "right",
                         no_wrap=col != "schedule", min_width=24 if col == "schedule" else None)
    for i, (name, *rest) in enumerate(rows):
        table.add_row(escape(str(name)), *map(str, rest),
                      style="bold green" if i == best_row else None)
    return table


def _spark(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in values)
