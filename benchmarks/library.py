"""Every library schedule's bubble rate and peak activation relative to 1F1B, at (p=8, m=24) and
(p=16, m=48), with unit costs and with docs/facts.md's profiled 1.5B-model times (zero-bubble paper,
Table 9: T_F=18.522, T_B=18.086, T_W=9.337, T_comm=0.601 ms). Each rank's times are split evenly
over the stages it holds; memory model M_W = M_B (B frees nothing until W); every schedule on
its own placement (the column says which), compared at its own memory (the x column).

    .venv/bin/python benchmarks/library.py
"""

from __future__ import annotations

import time

from flexpipe.cost import CostModel
from flexpipe.schedules import registry
from flexpipe.sim import simulate

CASES = [(8, 24), (16, 48)]
COSTS = {"unit": (1.0, 1.0, 1.0, 0.0), "1.5B": (18.522, 18.086, 9.337, 0.601)}


def _cost(name: str, sched) -> CostModel:  # type: ignore[no-untyped-def]
    f, b, w, comm = COSTS[name]
    return CostModel.per_rank(sched.placement.stage_rank, sched.num_ranks, f=f, b=b, w=w,
                              comm=comm)


def _build(name: str, p: int, m: int, cost_name: str):  # type: ignore[no-untyped-def]
    sched = registry.build(name, p, m)
    if registry.library()[name].cost_aware:
        sched = registry.build(name, p, m, cost=_cost(cost_name, sched))  # schedule for it
    return sched


def main() -> None:
    """Print the table."""
    header = f"{'schedule':<16} {'placement':<12}" + "".join(
        f" {f'{c} p={p} m={m}':>26}" for c in COSTS for p, m in CASES)
    print("bubble rate / peak activation (x 1F1B's)")
    print(header)
    rows: dict[str, list[str]] = {}
    base: dict[tuple[str, int, int], float] = {}
    t0 = time.perf_counter()
    for cost_name in COSTS:
        for p, m in CASES:
            for name in ["1f1b"] + [n for n in registry.names() if n != "1f1b"]:
                sched = _build(name, p, m, cost_name)
                met = simulate(sched, _cost(cost_name, sched)).metrics()
                peak = max(met.peak_activation)
                base.setdefault((cost_name, p, m), peak)
                rel = peak / base[(cost_name, p, m)]
                rows.setdefault(name, []).append(f"{met.bubble_rate:>8.4f} / {rel:>5.2f}x")
    for name, cells in rows.items():
        kind = registry.library()[name].placement_for(8).kind
        print(f"{name:<16} {kind:<12}" + "".join(f" {c:>26}" for c in cells))
    print(f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
