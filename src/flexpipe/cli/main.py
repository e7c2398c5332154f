"""The ``flexpipe`` entry point. ``COMMANDS`` is the one table of subcommands (name -> module and
one-line help); only the module of the command being run is imported, so ``flexpipe list`` never
pays for (or needs) torch. Bad input ends in one ``flexpipe: error: <reason>`` line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import NamedTuple, NoReturn

from flexpipe import __version__
from flexpipe.cli.config import COMMANDS as CONFIG_COMMANDS
from flexpipe.cli.config import apply as apply_config
from flexpipe.cli.config import config_path
from flexpipe.errors import ConfigError, FlexPipeError

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


class Command(NamedTuple):
    """Where a subcommand lives and what ``flexpipe --help`` says about it."""

    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "list": Command("flexpipe.cli.cmd_list", "list the library schedules, their parameters and "
                    "the torch/torchtitan names"),
    "show": Command("flexpipe.cli.cmd_show", "draw a simulated schedule as a terminal timeline"),
    "simulate": Command("flexpipe.cli.cmd_simulate", "simulate a schedule and print its metrics"),
    "draw": Command("flexpipe.cli.cmd_draw", "draw schedules to HTML/SVG/PNG or a Chrome trace"),
    "validate": Command("flexpipe.cli.cmd_validate", "check a schedule and list its violations"),
    "export": Command("flexpipe.cli.cmd_export", "write a schedule as text or torch CSV"),
    "run": Command("flexpipe.cli.cmd_run", "run a schedule for real on PyTorch"),
    "demo": Command("flexpipe.cli.cmd_demo", "the main job end to end: profile a model on 2 "
                    "local ranks, search, compare, train, write an HTML report"),
    "search": Command("flexpipe.cli.cmd_search", "find the best schedule under a memory limit"),
    "plan": Command("flexpipe.cli.cmd_plan", "plan stages, device mapping, schedule, micro-batch"),
}


class UsageError(Exception):
    """Bad command-line usage, reported by argparse."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises ``UsageError`` instead of printing usage and exiting, so
    every mistake ends in the same one-line message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv``: its first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def _load(name: str) -> ModuleType:
    """Import the module of command ``name``, with a clear error when it is not available."""
    module = COMMANDS[name].module
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            raise ConfigError(f"command {name!r} is not available in this installation "
                              f"({module} is missing)") from None
        raise ConfigError(f"command {name!r} needs the package {exc.name!r}, which is not "
                          f"installed") from None


def build_parser(command: str | None = None) -> Parser:
    """The parser; only ``command``'s module is imported and registered, the other commands are
    listed by name and help alone."""
    parser = Parser(prog="flexpipe", description="Programmable pipeline-parallel schedules: "
                    "list, draw, simulate, validate, export and run them; search for the best "
                    "one and plan stages and devices. 'flexpipe COMMAND --help' for each.")
    parser.add_argument("--version", action="version", version=f"flexpipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, cmd in COMMANDS.items():
        if name == command:
            _load(name).register(sub)
        else:
            sub.add_parser(name, help=cmd.help, add_help=False)
    return parser


def _dispatch(argv: list[str]) -> int:
    command = _command_of(argv)
    if command is not None and command not in COMMANDS:
        raise UsageError("flexpipe", f"unknown command {command!r}; "
                         f"choose from {', '.join(COMMANDS)}")
    parser = build_parser(command)
    path = config_path(argv)
    if path is not None and command in CONFIG_COMMANDS:
        apply_config(_subparser(parser, command), command, path)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    from flexpipe.cli.guards import outputs_apart

    outputs_apart(args)  # before any command works: no output replaces an input
    code = _load(args.command).run(args)
    return int(code or EXIT_OK)


def _subparser(parser: Parser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command``."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[command]
    return found


def _fail(prog: str, message: str) -> int:
    from flexpipe.cli.guards import safe

    lines = [safe(line) for line in message.strip().splitlines()] or ["unknown error"]
    print(f"{prog}: error: {lines[0]}", file=sys.stderr)
    for line in lines[1:]:
        print(f"  {line}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default ``sys.argv[1:]``) and return the exit code:
    0 ok, 1 an invalid schedule (``validate``), 2 bad input or usage."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(args)
    except UsageError as exc:
        return _fail(exc.prog, f"{exc} (see '{exc.prog} --help')")
    except FlexPipeError as exc:
        return _fail("flexpipe", str(exc))
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    except BrokenPipeError:
        sys.stderr.close()
        return EXIT_OK
    except KeyboardInterrupt:
        print("flexpipe: interrupted", file=sys.stderr)
        return 130
