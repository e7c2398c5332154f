"""``--config job.toml`` for ``run``, ``search`` and ``plan``: one TOML file in torchtitan's
spirit (pipeline degree, schedule, micro-batches and their size, split points, steps, global
batch, seed, model size) whose values become the command's defaults, so that flags given on the
command line override them. See examples/job.toml and docs/runtime.md.

Tables and keys:

- ``[parallelism]``: torchtitan's names (``pipeline_parallel_degree``,
  ``pipeline_parallel_schedule``, ``pipeline_parallel_microbatch_size``,
  ``pipeline_parallel_split_points``, ...; see ``KEYS``).
- ``[training]``: ``steps``, ``global_batch_size``, ``seed``, ``seq_len``,
  ``mixed_precision_param`` (``bfloat16``: bf16 compute on float32 master weights) and
  ``mixed_precision_reduce`` (``float32``).
- ``[model]``: ``name`` (the built-in model), ``layers``, ``hidden``, ``heads``, ``vocab``.
- ``[run]``, ``[search]``, ``[plan]``: any option of that command by its long name
  (``predict = true``, ``mem = 8``); an option the command does not have is an error.

torchtitan's own keys (``[job]``, ``[optimizer]``, ``[lr_scheduler]``, ``[checkpoint]``, ...)
are rewritten to these by ``flexpipe.cli.titan``, or refused with the reason.

A mapped key the command does not take (a schedule name for ``plan``) is ignored, so one file
serves all three commands; an unknown table or key is an error naming the file and the key, and
so are two keys that set one option to different values (``seed`` in ``[training]`` and in
``[run]``), naming both.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flexpipe.cli import titan
from flexpipe.errors import ConfigError

COMMANDS = ("run", "search", "plan")
KEYS: dict[str, str] = {
    "parallelism.pipeline_parallel_degree": "ranks",
    "parallelism.pipeline_parallel_schedule": "schedule",
    "parallelism.pipeline_parallel_microbatches": "microbatches",
    "parallelism.pipeline_parallel_microbatch_size": "micro_batch_size",
    "parallelism.pipeline_parallel_split_points": "split_points",
    "parallelism.pipeline_parallel_layers_per_stage": "partition",
    "parallelism.pipeline_parallel_chunks": "chunks",
    "parallelism.data_parallel_replicate_degree": "dp",
    "parallelism.tensor_parallel_degree": "tp",
    "parallelism.expert_parallel_degree": "ep",
    "training.steps": "steps",
    "training.global_batch_size": "global_batch_size",
    "training.seed": "seed",
    "training.seq_len": "seq",
    "training.mixed_precision_param": "mixed_precision",
    "training.mixed_precision_reduce": "mixed_precision_reduce",
    "model.name": "model",
    "model.layers": "layers",
    "model.hidden": "hidden",
    "model.heads": "heads",
    "model.vocab": "vocab",
}
"""``table.key`` -> the argparse destination it sets."""


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """``--config FILE``."""
    parser.add_argument("--config", metavar="FILE",
                        help="a job file (TOML, torchtitan-style: [parallelism], [training], "
                        "[model], and a table per command); flags given here override it")


def config_path(argv: Sequence[str]) -> str | None:
    """The value of ``--config`` in ``argv`` (``--config F`` or ``--config=F``), if any."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def read(path: str) -> dict[str, Any]:
    """The file's tables, flattened to ``table.key`` -> value."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--config {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path!r}: cannot read it ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    flat: dict[str, Any] = {}
    for table, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {table}: expected a table like [parallelism], "
                              f"got a {type(body).__name__}")
        for key, value in body.items():
            flat[f"{table}.{key}"] = value
    return flat


def apply(parser: argparse.ArgumentParser, command: str, path: str) -> None:
    """Make the file's values ``parser``'s defaults (flags on the command line win); an option
    the file supplies is no longer required."""
    actions = {a.dest: a for a in parser._actions}
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for name, value in titan.translate(path, read(path)).items():
        dest = _destination(path, name, command, actions)
        if dest is None or dest not in actions:
            continue
        values[dest] = _agree(path, dest, where.setdefault(dest, name), name, values.get(dest),
                              _convert(path, name, actions[dest], value), actions[dest])
    for dest in values:
        action = actions[dest]
        action.required = False
        if not action.option_strings:
            action.nargs = "?"
    parser.set_defaults(**values)


def _agree(path: str, dest: str, first: str, name: str, had: Any, value: Any,
           action: argparse.Action) -> Any:
    """``value``, unless ``first`` (another key of the file) already set ``dest`` to another
    value: then a ``ConfigError`` naming both keys (the file would not say which one wins)."""
    if first == name or had == value:
        return value
    option = action.option_strings[-1] if action.option_strings else dest
    raise ConfigError(f"{path}: {first} = {had!r} and {name} = {value!r} both set {option}, "
                      f"to different values; keep one of them")


def _destination(path: str, name: str, command: str,
                 actions: dict[str, argparse.Action]) -> str | None:
    """The destination ``name`` sets for ``command`` (None: another command's table)."""
    if name in KEYS:
        return KEYS[name]
    table, _, key = name.partition(".")
    if table in COMMANDS:
        if table != command:
            return None
        dest = key.replace("-", "_")
        if dest not in actions or dest in ("config", "help"):
            known = sorted(a.option_strings[-1].lstrip("-") for a in actions.values()
                           if a.option_strings and a.dest not in ("config", "help"))
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path}: {name}: 'flexpipe {command}' has no option "
                              f"--{key}{hint}")
        return dest
    close = difflib.get_close_matches(name, [*KEYS, *(f"{c}.OPTION" for c in COMMANDS)], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{path}: {name}: unknown key{hint}")


def _convert(path: str, name: str, action: argparse.Action, value: Any) -> Any:
    """``value`` as the command line would have given it (through the option's type)."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {name}: expected true or false, got {value!r}")
        return value
    _check_type(path, name, action, value)
    if isinstance(value, dict):
        value = [f"{k}={v}" for k, v in value.items()]
    items = value if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):
        return [_one(path, name, action, x) for x in items]
    text = ",".join(str(x) for x in items)
    return _one(path, name, action, text)


Kinds = tuple[type, ...]
TEXT: Kinds = (str,)
WHOLE: Kinds = (int,)
NUMBER: Kinds = (int, float)
ANY_SCALAR: Kinds = (str, int, float)
SCALARS: dict[str, Kinds] = {
    "": TEXT, "str": TEXT, "model_arg": TEXT,
    "int": WHOLE, "positive_int": WHOLE, "seed_arg": WHOLE,
    "float": NUMBER, "positive_number": NUMBER, "finite_number": NUMBER,
    "byte_size": ANY_SCALAR, "partition_arg": (str, int), "split_points_arg": (str, int),
    "parse_param": TEXT,
    "count": WHOLE, "fraction": NUMBER, "non_negative": NUMBER,
}
"""TOML value types an option takes, by the name of its argparse ``type`` (no type: a string);
an option whose type is not listed takes any string or number, as the command line would."""
LISTS = ("partition_arg", "split_points_arg")
"""Option types that also take a TOML list (joined with commas); so do ``LIST`` options and
repeatable ones (``--param``)."""


def _check_type(path: str, name: str, action: argparse.Action, value: Any) -> None:
    """A ``ConfigError`` naming the file and key when ``value``'s TOML type is not one the
    option takes (``checkpoint-dir = 5``, ``name = ["gpt"]``), before any conversion."""
    kind = getattr(action.type, "__name__", "") if action.type is not None else ""
    scalars = SCALARS.get(kind, ANY_SCALAR)
    listed = kind in LISTS or action.metavar == "LIST" or kind not in SCALARS or \
        isinstance(action, argparse._AppendAction)
    if isinstance(value, dict) and kind == "parse_param":
        return
    items = value if isinstance(value, list) and listed else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, scalars):
            want = " or ".join(_KIND_NAMES[t] for t in scalars)
            many = " (or a list of them)" if listed else ""
            raise ConfigError(f"{path}: {name}: expected {want}{many}, got "
                              f"{_toml_type(value)} {value!r}")


_KIND_NAMES = {str: "a string", int: "an integer", float: "a number"}


def _toml_type(value: Any) -> str:
    """The TOML name of ``value``'s type, for messages."""
    names = {bool: "a boolean", str: "a string", int: "an integer", float: "a float",
             list: "an array", dict: "a table"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


def _one(path: str, name: str, action: argparse.Action, value: Any) -> Any:
    convert = action.type if callable(action.type) else None
    try:
        out = convert(str(value)) if convert is not None else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: {name}: {exc}") from None
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"{path}: {name}: {out!r} is not one of "
                          f"{', '.join(map(str, action.choices))}")
    return out
