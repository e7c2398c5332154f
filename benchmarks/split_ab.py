"""ZB-H1 step time of two checkouts side by side: the split of this one against another's.

Each round trains the same jobs (ZB-H1 on 2 gloo ranks, 4 micro-batches: the built-in GPT and
Hugging Face GPT-2 cut in 2) once under each checkout, in child processes that import only that
checkout's ``src`` (``python -P``), in alternating order (old-new, new-old, ...), so that the
machine's drift reaches both alike; each job's time is its median step after the first. The
table gives each pair's ratio (new / old) and their median. Target: at most 1.03.

``--shares`` compares instead W's deferred share (the lowest stage's, cut at 2 and 4 stages,
one recorded forward) of every model of ``tests/runtime/tiny_models.py`` and every family of
``tests/runtime/hf_families.py`` under each checkout: the new one must defer at least as much.

    .venv/bin/python benchmarks/split_ab.py --old ../flexpipe-old [--pairs 4] [--steps 8]
    .venv/bin/python benchmarks/split_ab.py --old ../flexpipe-old --shares
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHILD = """
import json, statistics, sys
sys.path.insert(0, {bench!r})
import flexpipe
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.schedules import registry
steps = {steps}
gpt = ModelSpec("gpt", layers=4, hidden=256, heads=4, vocab=2048, seq=64, micro_batch=4)
hf = ModelSpec("user", factory="hf_models:gpt2_2")
jobs = [Job(registry.build("zb-h1", 2, 4), m, TrainConfig(steps=steps)) for m in (gpt, hf)]
out = launch(jobs, 2, timeout_s=300)
print(json.dumps([statistics.median(t for r in rs for t in r.step_times[1:]) * 1e3
                  for rs in out]))
"""
NAMES = ("built-in GPT", "HF GPT-2")
SHARES = """
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path[:0] = [{tests!r}, {bench!r}]
import hf_families as hf, tiny_models as tm
from flexpipe.runtime.measurement.shares import deferred_shares
from flexpipe.runtime.user.tracing import split_points
out = {{}}
cases = {{**{{n: tm.MODELS[n] for n in tm.MODELS}}, **{{n: hf.case(n) for n in hf.TABLE}}}}
for name, case in cases.items():
    got = []
    for stages, points in ((2, case.points2), (4, case.points4)):
        try:
            inputs, _ = case.batch(0, 4)
            cut = split_points(case.build(), points, inputs).segments
            got.append(min(deferred_shares(cut, inputs, stages)))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            got.append(type(exc).__name__)
    out[name] = got
print(json.dumps(out))
"""


def run(tree: Path, steps: int) -> list[float]:
    """Median step (ms) of each job under ``tree``'s code (its ``src`` and ``benchmarks``)."""
    bench = tree / "benchmarks"
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{bench}"}
    code = CHILD.format(bench=str(bench), steps=steps)
    done = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=bench,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return [float(v) for v in json.loads(done.stdout.strip().splitlines()[-1])]


def shares(tree: Path) -> dict[str, list[float | str]]:
    """Every model's lowest deferred share at 2 and 4 stages under ``tree``'s code."""
    bench, tests = tree / "benchmarks", tree / "tests" / "runtime"
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{bench}"}
    code = SHARES.format(tests=str(tests), bench=str(bench))
    done = subprocess.run([sys.executable, "-P", "-c", code], env=env, cwd=bench,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def share_table(old: Path, new: Path) -> None:
    """Print each model's shares, old and new, and the rows where the new one is lower."""
    before, after = shares(old), shares(new)
    lower = []
    print(f"{'model':<28}{'old 2':>8}{'4':>8}{'new 2':>8}{'4':>8}")
    for name in after:
        a, b = before.get(name, ["-", "-"]), after[name]
        print(f"{name:<28}" + "".join(f"{v:>{w}.3f}" if isinstance(v, float) else
                                      f"{'refused':>{w}}"
                                      for v, w in zip([*a, *b], (8, 8, 8, 8), strict=True)))
        if any(isinstance(x, float) and isinstance(y, float) and y < x - 1e-9
               for x, y in zip(a, b, strict=True)):
            lower.append(name)
    print(f"{len(after)} models (refused: a cut the model's own code refuses, in both); lower "
          f"than before: {', '.join(lower) or 'none'}")


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--shares", action="store_true", help="compare W's deferred shares")
    args = parser.parse_args()
    new = HERE.parent
    if args.shares:
        share_table(args.old, new)
        return
    ratios: list[list[float]] = [[] for _ in NAMES]
    print(f"old {args.old.resolve()}, new {new}; ZB-H1, 2 ranks, 4 micro-batches, "
          f"{args.steps} steps, {args.pairs} pairs in alternating order")
    print(f"{'pair':<6}" + "".join(f"{n + ' old':>18}{'new':>8}{'new/old':>9}" for n in NAMES))
    for k in range(args.pairs):
        order = [args.old, new] if k % 2 == 0 else [new, args.old]
        got = {tree: run(tree, args.steps) for tree in order}
        old, now = got[args.old], got[new]
        for i in range(len(NAMES)):
            ratios[i].append(now[i] / old[i])
        print(f"{k + 1:<6}" + "".join(f"{old[i]:>18.1f}{now[i]:>8.1f}{now[i] / old[i]:>9.3f}"
                                      for i in range(len(NAMES))), flush=True)
    print(f"{'median':<6}" + "".join(f"{'':>18}{'':>8}{statistics.median(r):>9.3f}"
                                     for r in ratios))


if __name__ == "__main__":
    main()
