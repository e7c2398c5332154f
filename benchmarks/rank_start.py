"""Rank start: the wall seconds of successive local launches from one program, ranks forked
from the preloaded server (``FLEXPIPE_START_METHOD=forkserver``, the default) against ranks
spawned anew (``spawn``), in one run, each method in a fresh Python process.

Every launch is ``flexpipe run 1f1b -p P -m 4 --steps 1`` (the built-in GPT), in process; the
table gives, per method and world size, the first launch (the fork server starts there), the
median of the later ones and the whole program, then the ratios forkserver / spawn.

    .venv/bin/python benchmarks/rank_start.py [--launches 3] [--worlds 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROGRAM = """
import json, sys, time
from flexpipe.cli.main import main
if __name__ == "__main__":
    out = []
    for _ in range({launches}):
        start = time.perf_counter()
        code = main(["run", "1f1b", "-p", "{world}", "-m", "4", "--steps", "1"])
        out.append(time.perf_counter() - start)
        assert code == 0, code
    print(json.dumps(out))
"""


def measure(method: str, world: int, launches: int) -> tuple[float, float, float]:
    """(first launch, median later launch, whole program) wall seconds under ``method``."""
    env = {**os.environ, "FLEXPIPE_START_METHOD": method}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(launches=launches, world=world)],
                          env=env, capture_output=True, text=True, check=True)
    total = time.perf_counter() - start
    seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return seconds[0], statistics.median(seconds[1:]), total


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    if args.launches < 2:
        parser.error("--launches must be at least 2 (a first launch and a later one)")
    print(f"{'ranks':>5} {'method':>10} {'first s':>8} {'later s':>8} {'program s':>9}")
    for world in args.worlds:
        rows = {m: measure(m, world, args.launches) for m in ("spawn", "forkserver")}
        for method, (first, later, total) in rows.items():
            print(f"{world:>5} {method:>10} {first:8.2f} {later:8.2f} {total:9.2f}")
        ratio = [f / s for f, s in zip(rows["forkserver"], rows["spawn"], strict=True)]
        print(f"{world:>5} {'ratio':>10} {ratio[0]:7.2f}x {ratio[1]:7.2f}x {ratio[2]:8.2f}x")


if __name__ == "__main__":
    main()
