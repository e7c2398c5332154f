"""Input generators for ``benchmarks/fuzz.py``: seeded, random and mutated inputs for every
FlexPipe entry point that reads user input. Each generator takes a ``random.Random`` and returns
a case: a thunk that calls the entry point, and a short description of the input."""

from __future__ import annotations

import copy
import json
import math
import string
from collections.abc import Callable
from functools import cache
from pathlib import Path
from random import Random
from typing import Any

from flexpipe.cost.io import cost_from_dict, load_cost
from flexpipe.cost.model import CostModel
from flexpipe.ir import KINDS, Op, Placement, Schedule, StageGraph, parse_schedule
from flexpipe.ir.lower import lower
from flexpipe.ir.torch_csv import from_torch_csv, to_torch_csv
from flexpipe.plan.inputs import load_cluster, load_model
from flexpipe.schedules.registry import build, library, names
from flexpipe.sim.validate import validate
from flexpipe.specs import load

Case = tuple[Callable[[], object], str]
ALPHABET = string.digits * 3 + "FBWRX_:>#-, \n\t\r\"'[]{}=.eE+" + "abzAZ" + "é\x00\u2028"
WEIRD: list[Any] = [0, -1, 1, 2, 3, 7, 2.5, -0.0, 1e308, math.inf, -math.inf, math.nan, "x", "",
                    "inf", "3", None, True, False, [], {}, [1, 2], [[1, 0], [0, 1]], {"F": 1},
                    10**30, "F", [None], {"": 0}]
SMALL_TEXT = "abc F B W 1 -1 0.5 : > # [ ] { } = , \" ' \n"


# --- text mutation ------------------------------------------------------------------------------

def _pos(rnd: Random, text: str) -> int:
    return rnd.randrange(len(text) + 1)


def _flip(rnd: Random, text: str) -> str:
    i = _pos(rnd, text)
    return text[:i] + rnd.choice(ALPHABET) + text[i + 1:]


def _delete(rnd: Random, text: str) -> str:
    i = _pos(rnd, text)
    return text[:i] + text[i + rnd.randint(1, 12):]


def _dup(rnd: Random, text: str) -> str:
    i = _pos(rnd, text)
    j = min(len(text), i + rnd.randint(1, 30))
    return text[:j] + text[i:j] + text[j:]


def _insert(rnd: Random, text: str) -> str:
    i = _pos(rnd, text)
    junk = rnd.choice(["999999999999", "-1", "0", " ", "\n", "#", ":", "rank 0:", "0ZZ0", "1F",
                       "nan", "inf", "1e999", "[", "]]", "{", "\"", "\\", "\x00", "é", "0>0",
                       "²", "٣", "１", "9" * 4400, "1e308", "\x1b[31m", "[/x]", "\u202e"])
    return text[:i] + junk + text[i:]


def _lines(rnd: Random, text: str) -> str:
    lines = text.split("\n")
    if len(lines) < 2:
        return text + "\n" + text
    i, j = rnd.randrange(len(lines)), rnd.randrange(len(lines))
    action = rnd.randrange(3)
    if action == 0:
        lines[i], lines[j] = lines[j], lines[i]
    elif action == 1:
        del lines[i]
    else:
        lines.insert(i, lines[j])
    return "\n".join(lines)


def _number(rnd: Random, text: str) -> str:
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    if not digits:
        return _flip(rnd, text)
    i = rnd.choice(digits)
    return text[:i] + str(rnd.choice([0, 1, 2, 5, 9, 10, 99, 10**9, 10**12])) + text[i + 1:]


def _truncate(rnd: Random, text: str) -> str:
    return text[:_pos(rnd, text)]


MUTATIONS = (_flip, _delete, _dup, _insert, _lines, _number, _truncate)


def mutate(rnd: Random, text: str) -> str:
    """``text`` with 1 to 4 random edits."""
    for _ in range(rnd.randint(1, 4)):
        text = rnd.choice(MUTATIONS)(rnd, text)
    return text


def random_text(rnd: Random, n: int = 80) -> str:
    """Random characters, biased to the formats' own punctuation."""
    return "".join(rnd.choice(ALPHABET + SMALL_TEXT) for _ in range(rnd.randint(0, n)))


def text_from(rnd: Random, corpus: list[str]) -> str:
    """A corpus item (5%), a random string (10%) or a mutated corpus item."""
    roll = rnd.random()
    if roll < 0.05:
        return rnd.choice(corpus)
    if roll < 0.15:
        return random_text(rnd)
    return mutate(rnd, rnd.choice(corpus))


# --- corpora ------------------------------------------------------------------------------------

@cache
def schedules() -> tuple[Schedule, ...]:
    """Small library schedules, lowered copies and a fork/join one."""
    out = [build(n, p, m) for n in names() for p, m in ((1, 1), (2, 2), (3, 4))
           if not (n in ("zb-v", "v-min", "v-half", "v-zb", "hanayo") and p == 1)
           and library()[n].builds(p, m)]
    out += [lower(s) for s in out[::4]]
    graph = StageGraph(3, ((0, 2), (1, 2)))
    ops = [[Op("F", 0, 0), Op("BW", 0, 0)], [Op("F", 1, 0), Op("BW", 1, 0)],
           [Op("F", 2, 0), Op("BW", 2, 0)]]
    out.append(Schedule.build(ops, Placement.linear(3), 1, graph, "fork"))
    return tuple(out)


@cache
def schedule_texts() -> list[str]:
    """The text form of every corpus schedule."""
    return [s.to_text() for s in schedules()]


@cache
def csv_texts() -> list[str]:
    """torch CSVs of the corpus schedules that hold only F, B, W and BW, on a chain of stages
    (what torch's CSV can express)."""
    out = []
    for s in schedules():
        if s.kinds() <= {"F", "B", "W", "BW"} and s.graph.chain_edges:
            out.append(to_torch_csv(s))
    return out


COST_SEEDS: list[dict[str, Any]] = [
    {"num_stages": 4, "default": {"F": 1.0, "B": 1.0, "W": 0.8, "act": 1.0, "wact": 0.5}},
    {"stages": [{"F": 1, "B": 2, "W": 1}, {"F": 1.5, "B": 2, "W": 1, "params": 2.0}],
     "comm": {"latency": 0.01, "bandwidth": 1e6}},
    {"num_stages": 2, "num_ranks": 2, "default": {"F": 1, "B": 1, "W": 1, "out_bytes": 10},
     "comm": {"latency": [[0, 1], [1, 0]], "bandwidth": ["inf", "inf"]}},
    {"transformer": {"layers": 8, "hidden": 512, "heads": 8, "seq": 128, "num_stages": 4}},
    {"transformer": {"layers": 4, "hidden": 64, "heads": 4, "seq": 16, "vocab": 100,
                     "layers_per_stage": [2, 2]}, "comm": {"latency": 0.1}},
]


def weird(rnd: Random) -> Any:
    """A fresh copy of a random odd value (never shared, so later edits cannot alias it)."""
    return copy.deepcopy(rnd.choice(WEIRD))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def mutate_data(rnd: Random, data: Any) -> Any:
    """A deep copy of ``data`` with 1 to 3 values replaced, keys dropped or added."""
    data = json.loads(json.dumps(data))
    for _ in range(rnd.randint(1, 3)):
        path = rnd.choice(_paths(data))
        if not path:
            continue
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        action = rnd.randrange(3)
        if action == 0:
            parent[path[-1]] = weird(rnd)
        elif action == 1 and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[rnd.choice(["F", "f", "stages", "act", "X", "comm", "extra", "1"])] = \
                weird(rnd)
    return data


def to_toml(data: dict[str, Any]) -> str:
    """A rough TOML writer (scalars, lists, tables, arrays of tables); good enough to fuzz."""
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float) and not math.isfinite(v):
            return "nan" if v != v else ("inf" if v > 0 else "-inf")
        if isinstance(v, int | float):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{json.dumps(str(k))} = {val(x)}" for k, x in v.items()) + "}"
        return json.dumps("" if v is None else str(v))

    lines = [f"{json.dumps(str(k))} = {val(v)}" for k, v in data.items()
             if not isinstance(v, dict | list) or (isinstance(v, list) and not
                                                    all(isinstance(x, dict) for x in v))]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append(f"[{json.dumps(str(k))}]")
            lines += [f"{json.dumps(str(a))} = {val(b)}" for a, b in v.items()]
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for item in v:
                lines.append(f"[[{json.dumps(str(k))}]]")
                lines += [f"{json.dumps(str(a))} = {val(b)}" for a, b in item.items()]
    return "\n".join(lines) + "\n"


# --- generators ---------------------------------------------------------------------------------

def gen_parse_schedule(rnd: Random) -> Case:
    text = text_from(rnd, schedule_texts())
    return (lambda: parse_schedule(text)), repr(text[:120])


def _placement_arg(rnd: Random) -> Placement | None:
    roll = rnd.random()
    if roll < 0.6:
        return None
    if roll < 0.8:
        return Placement.linear(rnd.randint(1, 4))
    return Placement.explicit([rnd.randrange(3) for _ in range(rnd.randint(1, 6))], 3)


def gen_torch_csv(rnd: Random) -> Case:
    text = text_from(rnd, csv_texts())
    placement = _placement_arg(rnd)
    mbs = rnd.choice([None, None, None, 1, 2, 4, 0, -1, True, 2.5, "3"])
    return (lambda: from_torch_csv(text, placement, mbs)), f"{text[:100]!r} mbs={mbs!r}"


def _cost_args(rnd: Random) -> tuple[int | None, int | None]:
    return rnd.choice([None, None, 1, 2, 4, 5]), rnd.choice([None, None, 1, 2, 4, 9])


def gen_cost_dict(rnd: Random) -> Case:
    data = mutate_data(rnd, rnd.choice(COST_SEEDS)) if rnd.random() < 0.9 else weird(rnd)
    n, k = _cost_args(rnd)
    return (lambda: cost_from_dict(data, n, k)), f"{data!r:.120} stages={n} ranks={k}"


def _file_case(tmp: Path, suffix: str, text: str, rnd: Random) -> Case:
    path = tmp / f"cost{suffix}"
    n, k = _cost_args(rnd)

    def thunk() -> CostModel:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        return load_cost(path, n, k)

    return thunk, f"{suffix}: {text[:100]!r}"


def gen_cost_json(rnd: Random, tmp: Path) -> Case:
    data = mutate_data(rnd, rnd.choice(COST_SEEDS))
    text = json.dumps(data)
    if rnd.random() < 0.4:
        text = mutate(rnd, text)
    if rnd.random() < 0.03:
        text = "[" * 5000 + "]" * 5000
    return _file_case(tmp, ".json", text, rnd)


def gen_cost_toml(rnd: Random, tmp: Path) -> Case:
    text = to_toml(mutate_data(rnd, rnd.choice(COST_SEEDS)))
    if rnd.random() < 0.4:
        text = mutate(rnd, text)
    return _file_case(tmp, ".toml", text, rnd)


def random_schedule(rnd: Random) -> Schedule:
    """A random (mostly invalid) schedule, or a library one with its ops shuffled about."""
    if rnd.random() < 0.5:
        base = rnd.choice(schedules())
        ranks = [list(ops) for ops in base.ranks]
        for _ in range(rnd.randint(1, 3)):
            r = rnd.randrange(len(ranks))
            if ranks[r]:
                i, j = rnd.randrange(len(ranks[r])), rnd.randrange(len(ranks[r]))
                action = rnd.randrange(3)
                if action == 0:
                    ranks[r][i], ranks[r][j] = ranks[r][j], ranks[r][i]
                elif action == 1:
                    del ranks[r][i]
                else:
                    ranks[rnd.randrange(len(ranks))].append(ranks[r][i])
        return base.with_ranks(ranks)
    p, v, m = rnd.randint(1, 3), rnd.randint(1, 2), rnd.randint(1, 3)
    stage_rank = [rnd.randrange(p) for _ in range(p * v)]
    kinds = [*KINDS.names(), "ZZ"]
    ranks2 = [[Op(rnd.choice(kinds), rnd.randint(-1, p * v), rnd.randint(-1, m))
               for _ in range(rnd.randint(0, 8))] for _ in range(p)]
    edges = tuple((a, b) for a in range(p * v) for b in range(a + 1, p * v) if rnd.random() < 0.4)
    graph = StageGraph(p * v, edges) if rnd.random() < 0.3 else None
    return Schedule.build(ranks2, Placement(tuple(stage_rank), p), m, graph)


def gen_validate(rnd: Random) -> Case:
    limit = rnd.choice([None, None, None, 1.0, 3, 0, -1, math.nan, [1, 2], "x"])

    def thunk() -> object:
        return validate(random_schedule(rnd), mem_limit=limit)  # type: ignore[arg-type]

    return thunk, f"seeded schedule, mem_limit={limit!r}"


def _name(rnd: Random) -> str:
    roll = rnd.random()
    base = rnd.choice(names())
    if roll < 0.7:
        return base if rnd.random() < 0.8 else base.upper()
    if roll < 0.9:
        return mutate(rnd, base)
    return random_text(rnd, 12)


PARAMS = ("v", "w", "U", "cost", "selective", "x")
VALUES: list[Any] = [1, 2, 3, 4, 0, -1, None, "a", 2.5, True, math.nan, [2]]


def gen_build(rnd: Random) -> Case:
    name = _name(rnd)
    p = rnd.choice([1, 2, 3, 4, 5, 8, 0, -1, True, 2.0, "4", None])
    m = rnd.choice([1, 2, 3, 4, 7, 8, 16, 0, -2, 1.5, "8", None])
    params = {k: rnd.choice([*VALUES, CostModel.per_rank(range(3), 3)])
              for k in rnd.sample(PARAMS, rnd.randint(0, 2))}
    return (lambda: build(name, p, m, **params)), f"{name!r} p={p!r} m={m!r} {params!r:.80}"


def gen_load_spec(rnd: Random) -> Case:
    spec = rnd.choice([_name(rnd), random_text(rnd, 20)]) + rnd.choice(
        ["", "", ".py", ".py:schedule", ".txt", ".csv", ".sched", ".toml", "/x.py", "\x00.txt",
         "a" * 300 + ".txt", ":", ".py:"])
    p, m = rnd.choice([None, 2, 4, 0]), rnd.choice([None, 2, 8, -1])
    return (lambda: load(spec, p, m)), f"{spec[:80]!r} p={p} m={m}"


# --- planner model and cluster files ------------------------------------------------------------

PLAN_MODEL_SEEDS: list[dict[str, Any]] = [
    {"name": "toy", "global_batch": 8, "micro_batch_sizes": [1, 2],
     "default": {"F": 1.0, "B": 1.0, "W": 0.5, "act": 10.0, "out_bytes": 4.0, "params": 1.0},
     "layers": [{"name": "embed", "F": 0.1}, {}, {"W": 0}, {"name": "head", "F": 2.0}]},
    {"transformer": {"layers": 4, "hidden": 64, "heads": 4, "seq": 16, "vocab": 100}},
    {"preset": "gpt-1.3b", "global_batch": 16},
]
PLAN_CLUSTER_SEEDS: list[dict[str, Any]] = [
    {"name": "pair", "devices": [{"memory_gb": 80}, {"memory_gb": 40, "speed": 0.5}],
     "links": {"bandwidth_gbs": [[0, 25], [12.5, 0]], "latency_ms": 0.01}},
    {"num_devices": 3, "device": {"memory_gb": 16}, "links": {"bandwidth_gbs": "inf"}},
    {"preset": {"topology": "random", "devices": 4, "seed": 2}},
]


def _plan_file(rnd: Random, tmp: Path, seeds: list[dict[str, Any]], stem: str,
               loader: Callable[[Path], object]) -> Case:
    data = mutate_data(rnd, rnd.choice(seeds))
    suffix = rnd.choice([".json", ".toml"])
    text = json.dumps(data) if suffix == ".json" else to_toml(data)
    if rnd.random() < 0.3:
        text = mutate(rnd, text)
    path = tmp / f"{stem}{suffix}"

    def thunk() -> object:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        return loader(path)

    return thunk, f"{suffix}: {text[:100]!r}"


def gen_plan_model(rnd: Random, tmp: Path) -> Case:
    return _plan_file(rnd, tmp, PLAN_MODEL_SEEDS, "model", load_model)


def gen_plan_cluster(rnd: Random, tmp: Path) -> Case:
    return _plan_file(rnd, tmp, PLAN_CLUSTER_SEEDS, "cluster", load_cluster)
