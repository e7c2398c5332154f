"""The search trading recompute for memory (``flexpipe.search.recompute``): each cell searches
the same cost model and limit with recompute (the default) and without (``recompute=False``),
and prints both bests' step time (makespan), the plan of the one that recomputes and the
search's CPU seconds both ways (each search in a fresh process, so that neither finds the
other's builds kept), in one table (ratios within one run).

1. A profile of a user model (``examples/sr_profile.json``: ``examples/my_sr_model.py`` under
   ``Recompute(drop=MLP)``, profiled by ``flexpipe run --predict --cost-out``), p = 4, m = 8,
   limits from a fifth of 1F1B's peak up to twice it.
2. The zero-bubble paper's 1.5B times (Table 9, M_W = M_B / 2; no profiled SR: SR is 10% of F
   and keeps 70% of M_B), p = 8, m = 24, limits 2 .. 16 M_B.
3. ``--timing``: the cost of the phase where nothing recomputes, 1.5B times at 1F1B's memory
   (p M_B), p = 16 m = 64 and p = 32 m = 128.

    PYTHONPATH=src .venv/bin/python benchmarks/search_recompute.py [--timing]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from flexpipe.cost import CostModel
from flexpipe.cost.io import load_cost
from flexpipe.search import search
from flexpipe.sim import simulate
from flexpipe.viz.units import fmt_memory

ROOT = Path(__file__).resolve().parents[1]


Found = tuple[str, float, str, float] | None
"""A search's best: label, makespan, recompute plan ("none"), and the search's CPU seconds."""


def _search(cost: CostModel, p: int, m: int, limit: float, recompute: bool) -> Found:
    """One search, in a fresh process (so that neither mode finds the other's builds kept)."""
    t0 = time.process_time()
    best = search(cost, p, m, limit, recompute=recompute).best_trial
    cpu = time.process_time() - t0
    if best is None:
        return None
    plan = best.recompute.stages_text() if best.recompute else "none"
    return best.label, best.makespan or 0.0, plan, cpu


def _fresh(cost: CostModel, p: int, m: int, limit: float, recompute: bool) -> Found:
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_search, cost, p, m, limit, recompute).result()


def _cell(cost: CostModel, p: int, m: int, limit: float) -> str:
    """One table row: the search without and with recompute at ``limit``."""
    plain, found = (_fresh(cost, p, m, limit, rc) for rc in (False, True))
    speed = f"{plain[1] / found[1]:.3f}x" if plain and found and found[1] else "-"
    cpu = [f"{x[3]:.2f}" if x else "-" for x in (plain, found)]
    return (f"| {fmt_memory(limit)} | {_name(plain)} | {_name(found)} | "
            f"{found[2] if found else '-'} | {speed} | {cpu[0]} | {cpu[1]} |")


def _name(found: Found) -> str:
    return "nothing fits" if found is None else f"{found[0]} ({found[1]:.4g})"


def _table(title: str, cost: CostModel, p: int, m: int, limits: list[float]) -> None:
    print(f"\n{title}")
    print("| limit | best without recompute (makespan) | best with recompute (makespan) | "
          "recompute | speed-up | CPU s without | CPU s with |")
    print("|---|---|---|---|---|---|---|")
    for limit in limits:
        print(_cell(cost, p, m, limit))


def profile_table() -> None:
    """Section 1."""
    from flexpipe.schedules.registry import build

    cost = load_cost(ROOT / "examples" / "sr_profile.json")
    p, m = 4, 8
    peak = max(simulate(build("1f1b", p, m), cost).metrics().peak_activation)
    limits = [peak * k / 10 for k in (2, 3, 4, 5, 6, 7, 8, 9, 10, 20)]
    _table(f"1. profile of examples/my_sr_model.py, p = {p}, m = {m} (1F1B peaks at "
           f"{fmt_memory(peak)}); makespans in ms", cost, p, m, limits)


def table9_table() -> None:
    """Section 2."""
    cost = CostModel.uniform(8, 8, f=18.522, b=18.086, w=9.337, act=1.0, wact=0.5, comm=0.601)
    _table("2. 1.5B times (Table 9), p = 8, m = 24; makespans in ms, limits in M_B", cost, 8,
           24, [2.0, 3.0, 4.0, 6.0, 8.0, 16.0])


def timing() -> None:
    """Section 3."""
    for p in (16, 32):
        cost = CostModel.uniform(p, p, f=18.522, b=18.086, w=9.337, act=1.0, wact=0.5,
                                 comm=0.601)
        _table(f"3. 1.5B times at p M_B, p = {p}, m = {4 * p}", cost, p, 4 * p, [float(p)])


def main() -> None:
    """Run the sections."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--timing", action="store_true", help="section 3 only")
    args = parser.parse_args()
    if args.timing:
        timing()
        return
    profile_table()
    table9_table()


if __name__ == "__main__":
    main()
