"""ZB-H1 step time of two checkouts side by side: the split of this one against another's.

Each round trains the same jobs (ZB-H1 on 2 gloo ranks, 4 micro-batches: the built-in GPT and
Hugging Face GPT-2 cut in 2) once under each checkout, in child processes that import only that
checkout's ``src`` (``python -P``), in alternating order (old-new, new-old, ...), so that the
machine's drift reaches both alike; each job's time is its median step after the first. The
table gives each pair's ratio (new / old) and their median. Target: at most 1.03.

    .venv/bin/python benchmarks/split_ab.py --old ../flexpipe-old [--pairs 4] [--steps 8]
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


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="the other checkout's root")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    new = HERE.parent
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
