"""Random small DSL programs for ``benchmarks/fuzz.py``: schedule programs assembled from
fragments that call the DSL API right and (mostly) wrong -- bad placements and counts, unknown
kinds, wrong ranks, bad policies, odd entry points (a builtin, a class, a number), syntax
errors, exceptions -- loaded through ``specs.load`` as a user's ``.py`` file would be.

No fragment loops forever, touches files or registers a new op kind (the registry is global to
the process): ``op_kind`` is only called with names it rejects."""

from __future__ import annotations

from pathlib import Path
from random import Random

from fuzz_gen import Case, mutate

from flexpipe.specs import load

INTS = ["p", "m", "0", "-1", "1", "2", "3", "'2'", "2.5", "None", "True", "[1]"]
KINDS = ["'F'", "'B'", "'W'", "'BW'", "'R'", "'ZZ'", "'f'", "''", "None", "3", "'SEND_F'"]
VALUES = ["None", "3", "'x'", "[]", "{}", "prog", "[0, 1]", "(1, 'F')", "lambda r: r",
          "float('nan')", "-1", "object()"]
PLACEMENTS = ["Placement.linear({a})", "Placement.interleaved({a}, {b})",
              "Placement.zigzag({a}, {b})", "Placement.explicit([0, 1, {a}])",
              "Placement.explicit([{a}], {b})", "Placement({a}, {b})", "{v}"]
POLICY = ["prefer={v}", "split={v}", "max_inflight={v}", "mem_limit={v}", "reserve={v}",
          "max_ahead={v}", "defer_w={v}", "priority={v}", "bogus={v}"]
BODY = [
    "    prog = Program({pl}, {a})\n",
    "    prog = Program({pl}, {a}, name={v})\n",
    "    for r in prog.ranks:\n        prog.order(r, prog.queue(r, {k}), prog.queue(r, {k2}))\n",
    "    for r in prog.ranks:\n        prog.order(r, alternate(prog.queue(r, {k}), "
    "prog.queue(r, {k2})), prog.queue(r, 'W'))\n",
    "    prog.order({a}, prog.queue(0, {k}))\n",
    "    prog.order(0, {v})\n",
    "    q = prog.queue({a}, {k}, order={v})\n",
    "    q = prog.queue(0, {k}, stages={v})\n",
    "    x = alternate(prog.queue(0, 'F'), {v}, counts={v2})\n",
    "    x = after_each(prog.queue(0, 'F'), prog.queue(0, 'B'), lag={a}, on={k})\n",
    "    x = interleave(prog.queue(0, 'F'), {v})\n",
    "    x = prog.queue(0, 'F').take({a})\n",
    "    return policy_schedule({pl}, {a}, Policy({pol}))\n",
    "    return policy_schedule(prog.placement, {a}, Policy({pol}), cost={v})\n",
    "    op_kind({bad}, 'doc', stream={v})\n",
    "    raise {exc}('boom')\n",
    "    return {v}\n",
    "    return prog\n",
    "    return prog.build()\n",
    "    import flexpipe_no_such_module\n",
    "    x = {a} // 0\n",
]
HEADS = [
    "def schedule(p, m):\n", "def schedule(p):\n", "def schedule(p, m, *, v):\n",
    "def schedule(*args, **kw):\n    p, m = 2, 2\n", "@entry\ndef first(p, m):\n",
    "def schedule(p, m, v=2, w=None):\n", "def other(p, m):\n", "async def schedule(p, m):\n",
]
ENDINGS = ["", "", "", "@entry\ndef second(p, m):\n    return None\n", "schedule = print\n",
           "schedule = 3\n", "class schedule:\n    def __init__(self, p, m):\n        pass\n",
           "schedule = lambda p, m: None\n", "schedule = Program\n", "schedule = len\n",
           "schedule = type\n", "del schedule\n", "raise SystemExit(3)\n",
           "import sys; sys.exit(0)\n"]
HEADERS = ["from flexpipe.dsl import *\n", "from flexpipe.dsl import Program, Placement\n",
           "import flexpipe.dsl as d\n", ""]
EXCEPTIONS = ["ValueError", "RuntimeError", "KeyError", "RecursionError", "MemoryError",
              "AssertionError", "StopIteration", "Exception"]
BAD_KINDS = ["'bad name'", "'f'", "''", "'9X'", "'F1'", "None", "3",
             "'F', needs=[1], time={'F': -1}"]


def _fill(rnd: Random, fragment: str) -> str:
    """``fragment`` with its placeholders replaced by random choices."""
    placement = rnd.choice(PLACEMENTS).format(a=rnd.choice(INTS), b=rnd.choice(INTS),
                                              v=rnd.choice(VALUES))
    policy = ", ".join(rnd.choice(POLICY).format(v=rnd.choice([*VALUES, "('B', 'F', 'W')"]))
                       for _ in range(rnd.randint(0, 3)))
    return fragment.format(pl=placement, a=rnd.choice(INTS), k=rnd.choice(KINDS),
                           k2=rnd.choice(KINDS), v=rnd.choice(VALUES), v2=rnd.choice(VALUES),
                           pol=policy, bad=rnd.choice(BAD_KINDS), exc=rnd.choice(EXCEPTIONS))


GOOD = ("from flexpipe.dsl import *\n\ndef schedule(p, m):\n"
        "    prog = Program(Placement.linear(p), m)\n"
        "    for r in prog.ranks:\n"
        "        prog.order(r, alternate(prog.queue(r, 'F'), prog.queue(r, {k})))\n"
        "    return prog\n")


def program(rnd: Random) -> str:
    """A random schedule program: a sensible one (a quarter of the time, its backward kind
    random), else a sensible shape, often wrong in one place."""
    if rnd.random() < 0.25:
        return GOOD.format(k=rnd.choice(["'BW'", "'BW'", "'B'", "'ZZ'"]))
    body = [_fill(rnd, BODY[0])]
    body += [_fill(rnd, rnd.choice(BODY)) for _ in range(rnd.randint(0, 4))]
    body.append(_fill(rnd, rnd.choice(BODY[-5:-2] + ["    return prog\n"] * 3)))
    text = rnd.choice(HEADERS) + rnd.choice(HEADS) + "".join(body) + rnd.choice(ENDINGS)
    return mutate(rnd, text) if rnd.random() < 0.1 else text


def gen_program(rnd: Random, tmp: Path) -> Case:
    """Write a random program and load it with random -p/-m and parameters."""
    path = tmp / f"prog{rnd.randrange(4)}.py"
    if rnd.random() < 0.15:  # a sound program, loaded soundly: the happy path stays covered
        text, p, m = GOOD.format(k="'BW'"), rnd.randint(1, 4), rnd.randint(1, 6)
        return _load_case(path, str(path), text, p, m, {})
    text = program(rnd)
    spec = str(path) + rnd.choice(["", "", "", "", "", ":schedule", ":first", ":nothing",
                                   ":Program", ":__builtins__", ":print", ":"])
    p, m = rnd.choice([1, 2, 3, 2, None, 0, -1]), rnd.choice([1, 2, 4, 2, None, 0])
    params = rnd.choice([{}, {}, {"v": 2}, {"w": None}, {"zz": 1}, {"v": "x"}])
    return _load_case(path, spec, text, p, m, params)


def _load_case(path: Path, spec: str, text: str, p: int | None, m: int | None,
               params: dict[str, object]) -> Case:
    def thunk() -> object:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        return load(spec, p, m, **params)

    return thunk, f"{spec.rsplit('/', 1)[-1]} p={p} m={m} {params}: {text[:300]!r}"
