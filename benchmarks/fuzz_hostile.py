"""Hostile-input generators for ``benchmarks/fuzz.py`` that are not mutations of FlexPipe's own
output: unicode and superscript digits, integers of thousands of digits, 1e308 and other
overflowing numbers, files nested hundreds deep, huge stage and micro-batch ids, names with
terminal escape sequences and markup, unwritable or existing output paths, and hostile flag
values; fed through the command line in-process (``flexpipe.cli.main.main``).

Each case also checks for *silent wrong results*: a command that exits 0 on a schedule the
validator rejects, JSON output that is not strict JSON, a non-finite figure, a name printed
with a raw escape character, an existing file overwritten without ``--force``. Such a case
raises ``WrongResult``."""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from random import Random
from typing import Any

from flexpipe.cli.main import main
from flexpipe.cost.io import load_cost
from flexpipe.errors import FlexPipeError
from flexpipe.sim.engine import simulate

Case = tuple[Callable[[], object], str]

UNICODE_DIGITS = ["²", "³", "¹", "٣", "۴", "५", "೬", "１", "𝟖", "⁹", "½", "Ⅻ"]
HUGE_INTS = ["9" * 5000, "1" + "0" * 4400, "9" * 40, "99999999999", "-" + "9" * 5000]
HUGE_FLOATS = ["1e308", "1.7976931348623157e308", "-1e308", "1e-320", "1e999", "4e18"]
HOSTILE_NAMES = ["\x1b[31mred\x1b[0m", "[/x]", "[bold]b", "\x07bell", "a\u202eb", "\x00z",
                 "\x9b2J", "e\u0301", "x" * 300, "\r\roverwrite", "tab\there"]
UNWRITABLE = ["/nonexistent/dir/out.txt", "/proc/version", "/", "{tmp}", "{tmp}/exists.txt",
              "{tmp}/no/such/dir.svg", "/dev/full"]
COMMANDS = ("simulate", "validate", "show", "export", "draw")
SEEDS = ("1f1b", "zb-h1", "gpipe", "zb-v", "interleaved-1f1b")


class WrongResult(Exception):
    """A command accepted hostile input and printed a wrong or unsafe result."""


def _schedule_text(rnd: Random) -> str:
    """A small library schedule's text with hostile edits: unicode digits, huge ids or counts,
    a hostile name, a dropped op."""
    from flexpipe.schedules.registry import build

    text = build(rnd.choice(SEEDS), rnd.choice([2, 3]), rnd.choice([2, 4])).to_text()
    lines = text.split("\n")
    for _ in range(rnd.randint(1, 3)):
        roll = rnd.randrange(5)
        if roll == 0:
            lines[1] = "name: " + rnd.choice(HOSTILE_NAMES)
        elif roll == 1:
            i = rnd.randrange(2, len(lines))
            digits = [k for k, c in enumerate(lines[i]) if c.isdigit()]
            if digits:
                k = rnd.choice(digits)
                token = rnd.choice(UNICODE_DIGITS + HUGE_INTS)
                lines[i] = lines[i][:k] + token + lines[i][k + 1:]
        elif roll == 2:
            lines[2] = f"ranks: 2 stages: 2 microbatches: {rnd.choice(HUGE_INTS[2:4])}"
        elif roll == 3:
            i = rnd.randrange(4, len(lines))
            ops = lines[i].split()
            if len(ops) > 3:
                del ops[rnd.randrange(2, len(ops))]
                lines[i] = " ".join(ops)
        else:
            lines.append(f"rank 0: 0F{rnd.choice(HUGE_INTS[2:4])}")
    return "\n".join(lines)


def _csv_text(rnd: Random) -> str:
    rows = rnd.choice([["0F0,0I0,0W0", "1F0,1I0,1W0"], ["0F999999999"], ["0F0"]])
    big = rnd.choice(["0F" + rnd.choice(HUGE_INTS), "0F" + rnd.choice(UNICODE_DIGITS),
                      rnd.choice(HOSTILE_NAMES)])
    if rnd.random() < 0.7:
        rows = [*rows, big]
    return "\n".join(rows) + "\n"


def _nested(rnd: Random, suffix: str) -> str:
    depth = rnd.choice([70, 500, 1000, 5000])
    if suffix == ".json":
        return '{"num_stages": 2, "x": ' + "[" * depth + "]" * depth + "}"
    return "num_stages = 2\nx = " + "[" * depth + "]" * depth + "\n"


def _cost_text(rnd: Random, suffix: str) -> str:
    """A cost file with one hostile number, or nested deep, or with a hostile name key."""
    roll = rnd.random()
    if roll < 0.2:
        return _nested(rnd, suffix)
    value = rnd.choice(HUGE_INTS + HUGE_FLOATS + UNICODE_DIGITS + ["1", "0.5", "2"])
    key = rnd.choice(["F", "B", "W", "act", "params", "out_bytes"])
    if value in UNICODE_DIGITS:
        value = f'"{value}"' if rnd.random() < 0.5 else value
    if suffix == ".json":
        comm = f', "comm": {{"bandwidth": {rnd.choice(HUGE_FLOATS + ["1e9"])}}}' \
            if rnd.random() < 0.3 else ""
        base = ", ".join(f'"{k}": 1' for k in ("F", "B", "W") if k != key)
        return f'{{"num_stages": 2, "default": {{{base}, "{key}": {value}}}{comm}}}'
    base = "".join(f"{k} = 1\n" for k in ("F", "B", "W") if k != key)
    return f"num_stages = 2\n[default]\n{base}{key} = {value}\n"


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return path


def _flags(rnd: Random) -> list[str]:
    """-p/-m: mostly small, sometimes hostile (unicode digits, huge, negative)."""
    out = []
    for flag in ("-p", "-m"):
        roll = rnd.random()
        if roll < 0.75:
            out += [flag, str(rnd.choice([1, 2, 3, 4, 8]))]
        elif roll < 0.9:
            out += [flag, rnd.choice(UNICODE_DIGITS + HUGE_INTS + ["-1", "0", "1e3"])]
        else:
            out += [flag, str(rnd.choice([10**5, 10**6, 10**9]))]
    return out


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``flexpipe ARGV`` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _strict_json(text: str) -> Any:
    def bad(name: str) -> float:
        raise WrongResult(f"JSON output holds {name}")
    try:
        return json.loads(text, parse_constant=bad)
    except json.JSONDecodeError as exc:
        raise WrongResult(f"output is not JSON ({exc.msg})") from None


def _judge(argv: list[str], code: int, out: str, err: str, spec: str) -> None:
    """Raise ``WrongResult`` for a silent wrong or unsafe result."""
    if code not in (0, 1, 2):
        raise WrongResult(f"exit code {code}")
    if "\x1b" in out or "\x1b" in err or "\x07" in out:
        raise WrongResult("a raw escape character reached the terminal")
    if code != 0:
        return
    if "--json" in argv:
        figures = _strict_json(out)
        if not all(math.isfinite(v) for v in figures.values() if isinstance(v, float)):
            raise WrongResult("a non-finite figure")
    if argv[0] in ("simulate", "show", "draw", "export") and "--no-validate" not in argv \
            and os.path.isfile(spec):
        again, _, _ = run_cli(["validate", spec, "--no-size-guard"])
        if again != 0:
            raise WrongResult(f"{argv[0]} exit 0 on a schedule validate rejects")


def gen_cli_schedules(rnd: Random, tmp: Path) -> Case:
    """A command on a hostile schedule file or a library name with hostile flags."""
    command = rnd.choice(COMMANDS)
    roll = rnd.random()
    if roll < 0.45:
        spec = str(_write(tmp / "s.txt", _schedule_text(rnd)))
    elif roll < 0.6:
        spec = str(_write(tmp / "s.csv", _csv_text(rnd)))
    else:
        spec = rnd.choice([*SEEDS, "ZB-H1", rnd.choice(HOSTILE_NAMES)])
    argv = [command, spec]
    if not os.path.isfile(spec) or rnd.random() < 0.3:
        argv += _flags(rnd)
    if rnd.random() < 0.3:
        suffix = rnd.choice([".json", ".toml"])
        argv += ["--cost", str(_write(tmp / f"c{suffix}", _cost_text(rnd, suffix)))]
    if command in ("simulate",) and rnd.random() < 0.5:
        argv.append("--json")
    if command == "draw":
        argv += ["-o", str(tmp / "d.svg"), "--force"]
    if command in ("show",):
        argv += ["--width", "100", "--no-color"]

    def thunk() -> None:
        code, out, err = run_cli(argv)
        _judge(argv, code, out, err, spec)
        if code:
            raise FlexPipeError(err.strip()[:200])  # refused with a message: a rejection

    return thunk, " ".join(repr(a)[:60] for a in argv)


def gen_cli_outputs(rnd: Random, tmp: Path) -> Case:
    """A command that writes a file, to an unwritable, missing, existing or odd path."""
    existing = _write(tmp / "exists.txt", "keep me\n")
    path = rnd.choice(UNWRITABLE + [str(tmp / "fresh.txt"), str(tmp / "fresh.svg")])
    path = path.replace("{tmp}", str(tmp))
    force = rnd.random() < 0.3
    command = rnd.choice(["export", "draw", "search"])
    if command == "draw" and not path.endswith((".svg", ".html", ".json")):
        path += rnd.choice([".svg", ""])
    argv = {"export": ["export", "1f1b", "-p", "2", "-m", "2", "-o", path],
            "draw": ["draw", "zb-h1", "-p", "2", "-m", "2", "-o", path],
            "search": ["search", "-p", "2", "-m", "4", "--mem", "2", "-o", path]}[command]
    argv += ["--force"] if force else []

    def thunk() -> None:
        for fresh in ("fresh.txt", "fresh.svg"):
            (tmp / fresh).unlink(missing_ok=True)
        _write(existing, "keep me\n")
        code, out, err = run_cli(argv)
        _judge(argv, code, out, err, "")
        if not force and existing.read_text() != "keep me\n":
            raise WrongResult("an existing file was overwritten without --force")
        if code == 0 and path.startswith(str(tmp)) and not os.path.exists(path):
            raise WrongResult("exit 0 but the output file is not there")
        if code:
            raise FlexPipeError(err.strip()[:200])

    return thunk, " ".join(argv)


def gen_cost_numbers(rnd: Random, tmp: Path) -> Case:
    """A cost file with huge or unicode numbers or deep nesting: refused, or accepted with
    every simulated figure finite."""
    suffix = rnd.choice([".json", ".toml"])
    text = _cost_text(rnd, suffix)
    path = tmp / f"cost{suffix}"

    def thunk() -> None:
        _write(path, text)
        cost = load_cost(path, 2, 2)
        from flexpipe.schedules.registry import build

        metrics = simulate(build("1f1b", 2, 4), cost).metrics()
        if not math.isfinite(metrics.makespan):
            raise WrongResult(f"makespan {metrics.makespan} from an accepted cost file")

    return thunk, f"{suffix}: {text[:100]!r}"
