"""Simulator throughput: compute ops simulated per second (full simulate(): compile, event loop,
memory curves), and metrics on top. Target: >= 500,000 ops/s on the 2-core dev machine.

    .venv/bin/python benchmarks/sim_speed.py
"""

from __future__ import annotations

import time

from flexpipe.schedules import registry
from flexpipe.sim import default_cost, simulate

CASES = [("1f1b", 64, 1024), ("zb-h1", 32, 512)]
TARGET = 500_000


def _best_of(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    """Print one row per case."""
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
