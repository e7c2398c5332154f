"""Options and steps the commands share: the schedule spec (library name or file) with -p, -m,
-v and ``--param KEY=VALUE``; ``--cost FILE``; loading, simulating and the rich console.

Every command that reads a schedule loads it through ``load_schedule``, the one gate: a size
guard before any work (``flexpipe.cli.guards``: the memory that building and simulating it
would take, against this machine's; ``--no-size-guard`` to go on anyway), then the validator
(an invalid schedule is refused with the validator's message; ``--no-validate`` shows it
anyway under a banner saying its figures are not those of a valid schedule)."""

from __future__ import annotations

import argparse
import math
import os
import typing

from rich.console import Console

from flexpipe.cli import guards
from flexpipe.cost import io as cost_io
from flexpipe.cost.limits import HELP as LIMIT_HELP
from flexpipe.cost.limits import MemLimit
from flexpipe.cost.limits import parse as parse_limit
from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.trace import Trace

Value = int | float | bool | str | None
WORDS: dict[str, Value] = {"true": True, "false": False, "none": None}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1, in ASCII digits (at most 18 of them)."""
    try:
        if not text.strip().isascii() or len(text.strip()) > 18:
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        if not text.isascii():
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_value(text: str) -> Value:
    """A parameter value: int, then finite float (ASCII, at most 18 digits), then
    true/false/none, else the string itself."""
    for convert in (int, float):
        try:
            value = convert(text) if text.isascii() and len(text) <= 18 else None
        except ValueError:
            continue
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
            return value
    return WORDS.get(text.lower(), text)


def parse_param(text: str) -> tuple[str, Value]:
    """argparse type for ``--param KEY=VALUE``."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. w=2), got {text!r}")
    return key, parse_value(value.strip())


def add_schedule_args(parser: argparse.ArgumentParser, spec_help: str | None = None,
                      gate: bool = True) -> None:
    """The schedule spec and its generator options; with ``gate``, ``--no-validate`` (commands
    that validate on their own, ``validate`` and ``run``, pass False)."""
    parser.add_argument("schedule", metavar="NAME|FILE",
                        help=spec_help or "library schedule name (see 'flexpipe list') or a "
                        "schedule file (.txt/.sched text, .csv torch CSV, .py DSL program)")
    parser.add_argument("-p", "--ranks", type=positive_int, metavar="P",
                        help="pipeline ranks (devices)")
    parser.add_argument("-m", "--microbatches", type=positive_int, metavar="M",
                        help="number of micro-batches per iteration (a count, not their size)")
    parser.add_argument("-v", "--chunks", type=positive_int, metavar="V",
                        help="stages (chunks) per rank, for schedules that take v")
    parser.add_argument("--param", type=parse_param, action="append", default=[],
                        metavar="KEY=VALUE",
                        help="extra generator parameter (repeatable), e.g. --param w=2")
    parser.add_argument("--program-timeout", type=positive_number, metavar="SECONDS",
                        help="stop a .py schedule program that runs longer (default 60)")
    if gate:
        parser.add_argument("--no-validate", action="store_true",
                            help="show a schedule the validator rejects (for debugging; its "
                            "figures are not those of a valid schedule)")
    add_guard_arg(parser)


def add_guard_arg(parser: argparse.ArgumentParser) -> None:
    """``--no-size-guard``: go on when the work looks too big for this machine."""
    parser.add_argument("--no-size-guard", action="store_true",
                        help="go on even when the estimated memory exceeds what this machine "
                        "has available")


def mem_limit(text: str) -> MemLimit:
    """argparse type: a memory limit (``flexpipe.cost.limits``): ``8`` in M_B, ``6GiB`` in
    bytes, one per rank with commas."""
    try:
        return parse_limit(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_mem_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--mem LIMIT``, the one memory-limit flag: ``what`` says what the command does with it."""
    parser.add_argument("--mem", type=mem_limit, metavar="LIMIT", help=f"{what}; {LIMIT_HELP}")


def add_cost_arg(parser: argparse.ArgumentParser) -> None:
    """``--cost FILE``; without it every rank's F, B, W take 1 time unit."""
    parser.add_argument("--cost", metavar="FILE",
                        help="cost model file (default: unit costs, F = B = W = 1 per rank)")


def generator_params(args: argparse.Namespace) -> dict[str, Value]:
    """The generator keyword parameters from -v and --param; a key given twice is an error."""
    params: dict[str, Value] = {}
    for key, value in args.param:
        if key in params:
            raise ConfigError(f"parameter {key!r} is given twice")
        params[key] = value
    if args.chunks is not None:
        if "v" in params:
            raise ConfigError("give the chunk count once: -v or --param v=..., not both")
        params["v"] = args.chunks
    return params


PARAM_KINDS: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "true or false"),
    int: ((int,), "an integer"),
    float: ((int, float), "a number"),
    str: ((str,), "a string"),
}
"""What a library generator's parameter takes, by the type of its default (or of its
annotation when the default is None)."""


def _param_kind(fn: object, key: str, default: object) -> tuple[tuple[type, ...], str] | None:
    """The types ``key`` of generator ``fn`` takes, and their name (None: not known)."""
    if default is not None:
        return PARAM_KINDS.get(type(default))
    try:
        hint = typing.get_type_hints(fn).get(key)
    except (NameError, TypeError):
        return None
    found = [PARAM_KINDS[t] for t in typing.get_args(hint) if t in PARAM_KINDS]
    return found[-1] if len(found) == 1 or (found and found[0][0] == (int,)) else None


def check_param_types(spec: str, params: dict[str, Value]) -> None:
    """Refuse a ``--param`` value of the wrong type for a library schedule's parameter
    (``selective=maybe`` is not true or false; ``v=2.5`` is not an integer), naming both."""
    from flexpipe.schedules.registry import library, resolve

    entry = library().get(resolve(spec).lower())
    if entry is None:
        return
    defaults = dict(entry.params)
    for key, value in params.items():
        kind = _param_kind(entry.fn, key, defaults[key]) if key in defaults else None
        if kind is None or value is None:
            continue
        types, name = kind
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ConfigError(f"--param {key}={value!r}: schedule {spec!r} takes {name} for "
                              f"{key}, got {type(value).__name__} {value!r}")


def load_schedule(args: argparse.Namespace, **extra: object) -> Schedule:
    """The schedule named by ``args`` (library name or file); ``extra`` generator parameters."""
    from flexpipe.specs import load

    params = {**generator_params(args), **extra}
    check_param_types(args.schedule, generator_params(args))
    guards.before_load(args.schedule, args.ranks, args.microbatches, params, _forced(args))
    schedule = load(args.schedule, args.ranks, args.microbatches,
                    program_timeout_s=getattr(args, "program_timeout", None), **params)
    for what, asked, got in (("ranks", args.ranks, schedule.num_ranks),
                             ("micro-batches", args.microbatches, schedule.microbatches)):
        if asked is not None and asked != got:
            raise ConfigError(f"{args.schedule}: the schedule has {got} {what}, not {asked}")
    guards.after_load(schedule, args.schedule, _forced(args))
    if hasattr(args, "no_validate"):
        guards.gate(schedule, args.schedule, args.no_validate)
    return schedule


def _forced(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "no_size_guard", False))


def load_cost(args: argparse.Namespace, schedule: Schedule) -> CostModel | None:
    """The cost model of ``--cost`` fitted to ``schedule``, or None (unit costs);
    ``preset:NAME[:LAYOUT]`` is a graph preset's cost model on the schedule's ranks."""
    path = getattr(args, "cost", None)
    if path is None:
        return None
    if path.startswith("preset:"):
        from flexpipe.graphs import preset_cost

        name, _, layout = path[len("preset:"):].partition(":")
        return preset_cost(name, schedule, layout or None)
    return read_cost(path, schedule.num_stages, schedule.num_ranks)


def read_cost(path: str, num_stages: int | None = None,
              num_ranks: int | None = None) -> CostModel:
    """The cost file at ``path`` (``--cost``), fitted to a schedule's stages and ranks when
    they are given; a clear error when there is no such file."""
    if not os.path.isfile(path):
        raise ConfigError(f"cost file {path!r} does not exist")
    return cost_io.load_cost(path, num_stages=num_stages, num_ranks=num_ranks)


def _takes_cost(args: argparse.Namespace) -> bool:
    """Whether the schedule is a library generator that plans for a ``cost`` model."""
    from flexpipe.schedules.registry import library, resolve

    entry = library().get(resolve(args.schedule).lower())
    given = {key for key, _ in args.param}
    return entry is not None and entry.cost_aware and "cost" not in given


def schedule_and_cost(args: argparse.Namespace) -> tuple[Schedule, CostModel | None]:
    """The schedule and the ``--cost`` model; a generator that takes a cost model (V-shape,
    ZB-V, ...) is built for that model rather than for unit costs."""
    schedule = load_schedule(args)
    cost = load_cost(args, schedule)
    if cost is not None and _takes_cost(args):
        schedule = load_schedule(args, cost=cost)
    return schedule, cost


def simulate_args(args: argparse.Namespace) -> Trace:
    """Load the schedule and cost of ``args`` and simulate."""
    from flexpipe.sim.engine import simulate

    trace = simulate(*schedule_and_cost(args))
    span = trace.metrics().makespan
    if not math.isfinite(span):
        raise ConfigError(f"the simulation of {guards.safe(args.schedule)} overflowed (makespan "
                          f"{span}): the cost model's numbers are too large")
    return trace


def describe(schedule: Schedule) -> str:
    """One line for the rich console: name (control characters and markup escaped), ranks,
    stages, micro-batches, op count."""
    from rich.markup import escape

    name = escape(guards.safe(schedule.name)) or "(unnamed)"
    return (f"{name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
            f"{schedule.microbatches} micro-batches, {len(schedule)} ops")


def console(width: int | None = None) -> Console:
    """A rich console on stdout: colour only on a terminal and never when NO_COLOR is set."""
    return Console(width=width, highlight=False, soft_wrap=False)


def use_color(out: Console, no_color: bool = False) -> bool:
    """Whether to draw in colour on ``out``."""
    return not no_color and not out.no_color and out.color_system is not None
