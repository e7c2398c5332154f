"""``flexpipe draw``: simulate one or several schedules and write a picture or a trace file; the
output's suffix picks the format (one table, ``WRITERS``):

- ``.html``: self-contained page (timelines on one time axis, memory curves, metrics tables);
- ``.svg``: the same picture as a standalone SVG;
- ``.png``: the SVG rendered by headless Chromium/Chrome (a clear error when none is installed);
- ``.json``: Chrome trace / Perfetto JSON (``flexpipe.viz.chrome``), times converted with
  ``--time-unit`` (the unit of the cost model's times, ms by default) to microseconds.

Several schedules (``flexpipe draw 1f1b zb-h1 zb-v -p 4 -m 8 -o cmp.html``) share -p, -m, -v,
--param and --cost and are drawn on one time axis; name the schedules before the options.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from flexpipe.cli import guards
from flexpipe.cli.common import add_cost_arg, add_schedule_args, schedule_and_cost
from flexpipe.errors import ConfigError
from flexpipe.sim.trace import Trace
from flexpipe.viz.units import Units, units_for

UNITS_US = {"us": 1.0, "ms": 1000.0, "s": 1e6}
Writer = Callable[[list[Trace], list[str], argparse.Namespace], None]


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``draw`` subcommand."""
    parser = sub.add_parser("draw", help="draw schedules to HTML/SVG/PNG or a Chrome trace",
                            description="Simulate one or several schedules and write a picture "
                            "(.html, .svg, .png) or a Chrome trace / Perfetto file (.json). "
                            "Several schedules are drawn on one time axis.")
    add_schedule_args(parser)
    parser.add_argument("more", nargs="*", metavar="NAME|FILE",
                        help="more schedules to compare (same -p, -m, -v, --param, --cost)")
    add_cost_arg(parser)
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help=f"output file; its suffix picks the format ({', '.join(WRITERS)})")
    parser.add_argument("--width", type=int, default=1200, metavar="PX",
                        help="picture width in pixels (default 1200)")
    parser.add_argument("--title", default="", help="page title (HTML)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite the output file if it exists")
    parser.add_argument("--time-unit", choices=sorted(UNITS_US), default="ms",
                        help="unit of the cost model's times, for .json (default ms)")


def _write(path: str, content: str) -> None:
    guards.write_text(path, content)


def _layout(args: argparse.Namespace) -> object:
    from flexpipe.viz.svg import Layout

    if not 400 <= args.width <= 8000:
        raise ConfigError(f"--width must be between 400 and 8000 pixels, got {args.width}")
    return Layout(width=args.width)


def _units(args: argparse.Namespace) -> Units:
    """ms with a cost model, unit costs without one."""
    return units_for(args.cost)


def _html(traces: list[Trace], titles: list[str], args: argparse.Namespace) -> None:
    from flexpipe.viz.html import page

    _write(args.output, page(traces, titles, args.title, _layout(args),  # type: ignore[arg-type]
                             units=_units(args)))


def _svg(traces: list[Trace], titles: list[str], args: argparse.Namespace) -> None:
    from flexpipe.viz.svg import document

    _write(args.output, document(traces, titles, _layout(args),  # type: ignore[arg-type]
                                 units=_units(args)))


def _png(traces: list[Trace], titles: list[str], args: argparse.Namespace) -> None:
    from flexpipe.viz.html import svg_page
    from flexpipe.viz.png import screenshot
    from flexpipe.viz.svg import document, document_size

    svg = document(traces, titles, _layout(args), units=_units(args))  # type: ignore[arg-type]
    screenshot(svg_page(svg), args.output, *document_size(svg))


def _json(traces: list[Trace], titles: list[str], args: argparse.Namespace) -> None:
    from flexpipe.viz.chrome import dumps

    _write(args.output, dumps(traces, titles, UNITS_US[args.time_unit]))


WRITERS: dict[str, Writer] = {".html": _html, ".htm": _html, ".svg": _svg, ".png": _png,
                              ".json": _json}


def _traces(args: argparse.Namespace) -> tuple[list[Trace], list[str]]:
    from flexpipe.sim.engine import simulate

    traces, titles = [], []
    for spec in [args.schedule, *args.more]:
        one = argparse.Namespace(**{**vars(args), "schedule": spec})
        schedule, cost = schedule_and_cost(one)
        traces.append(simulate(schedule, cost))
        titles.append(guards.safe(schedule.name or Path(spec).stem))
    return traces, titles


def run(args: argparse.Namespace) -> int:
    """Simulate every schedule and write the output."""
    suffix = Path(args.output).suffix.lower()
    if suffix not in WRITERS:
        raise ConfigError(f"cannot tell the format of {args.output!r} from its suffix; use one "
                          f"of {', '.join(WRITERS)}")
    guards.check_output(args.output, args.force)
    _layout(args)  # a bad --width is refused before the work
    traces, titles = _traces(args)
    WRITERS[suffix](traces, titles, args)
    what = ", ".join(titles)
    print(f"wrote {args.output} ({what})")
    return 0
