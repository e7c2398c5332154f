"""Simulator throughput: compute ops simulated per second (full simulate(): compile, event loop,
memory curves), and metrics on top. Target: >= 500,000 ops/s on the 2-core dev machine.
Validator: a 4000-rank chain (1F1B, m = 1) and a 1,000,000-op two-rank schedule (1F1B,
m = 250,000), each within 5 s, with the process's peak memory (issue 30).

    .venv/bin/python benchmarks/sim_speed.py [--validate]
"""

from __future__ import annotations

import os
import resource
import sys
import time

from flexpipe.schedules import registry
from flexpipe.sim import default_cost, simulate
from flexpipe.sim.validate import validate

CASES = [("1f1b", 64, 1024), ("zb-h1", 32, 512)]
TARGET = 500_000


def _best_of(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


VALIDATE = [("1f1b", 4000, 1), ("1f1b", 2, 250_000)]
VALIDATE_TARGET = 5.0


def validation() -> None:
    """Seconds and memory of ``validate`` on the issue's two shapes."""
    print(f"validate (load average {os.getloadavg()[0]:.1f}): {'schedule':<6} {'p':>5} "
          f"{'m':>7} {'ops':>9} {'seconds':>8} {'ops/s':>10} {'peak RSS MB':>12}  target")
    for name, p, m in VALIDATE:
        sched = registry.build(name, p, m)
        t0 = time.perf_counter()
        found = validate(sched)
        dt = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        ok = "ok" if dt <= VALIDATE_TARGET and not found else "MISSED"
        print(f"{'':<38}{name:<6} {p:>5} {m:>7} {len(sched):>9} {dt:>8.2f} "
              f"{len(sched) / dt:>10,.0f} {rss:>12.0f}  {ok} (<= {VALIDATE_TARGET:g} s)")


def main() -> None:
    """Print one row per case (``--validate``: the validator's rows only)."""
    if "--validate" in sys.argv[1:]:
        validation()
        return
    print(f"{'schedule':<10} {'p':>4} {'m':>6} {'ops':>9} {'simulate s':>11} {'ops/s':>11} "
          f"{'+metrics ops/s':>15}  target")
    for name, p, m in CASES:
        sched = registry.build(name, p, m)
        cost = default_cost(sched)
        ops = len(sched)
        t_sim = _best_of(lambda: simulate(sched, cost))  # noqa: B023
        t_all = _best_of(lambda: simulate(sched, cost).metrics())  # noqa: B023
        ok = "ok" if ops / t_sim >= TARGET else "BELOW"
        print(f"{name:<10} {p:>4} {m:>6} {ops:>9} {t_sim:>11.3f} {ops / t_sim:>11,.0f} "
              f"{ops / t_all:>15,.0f}  {ok} (>= {TARGET:,})")


if __name__ == "__main__":
    main()
