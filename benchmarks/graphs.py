"""Models that are not chains, searched at p = 8: per preset (two-tower CLIP, encoder-decoder,
GPT with its embedding and head sharded over every device), the best schedule the automated
scheduler finds over the preset's layouts (then improved by the CP-SAT optimiser by windows),
its bubble rate and peak activation, and the speedup over what a chain-only framework does: the
same layers one after another on a balanced chain, scheduled with 1F1B. The memory limit is the
baseline's own peak (equal memory). Target: each search under 60 s.

    .venv/bin/python benchmarks/graphs.py [-p 8] [-m 24] [--no-exact] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from flexpipe.graphs import PRESETS, chain_baseline, preset_layouts
from flexpipe.search.graphs import search_graph
from flexpipe.sim import simulate

TARGET_S = 60.0
GB = 1e9


def _row(name: str, p: int, m: int, exact: bool, out: Path | None) -> str:
    models = preset_layouts(name, p)
    base = simulate(*chain_baseline(models[0], m)).metrics()
    t0 = time.perf_counter()
    result = search_graph(models, m, exact=exact, time_limit=10.0)
    seconds = time.perf_counter() - t0
    best = result.best_trial
    if best is None or best.makespan is None or result.best is None:
        return f"{name:<18} no schedule fits the baseline's memory"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.txt").write_text(result.best.to_text(), encoding="utf-8")
    ok = "ok" if seconds < TARGET_S else "SLOW"
    return (f"{name:<18} {best.label[:58]:<58} {best.makespan:>9.1f} {best.bubble_rate:>7.3f} "
            f"{(best.peak or 0) / GB:>7.2f} {base.makespan:>9.1f} {base.bubble_rate:>7.3f} "
            f"{max(base.peak_activation) / GB:>7.2f} {base.makespan / best.makespan:>7.3f}x "
            f"{seconds:>6.1f} {ok}")


def main() -> None:
    """Print one row per preset."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-p", type=int, default=8)
    ap.add_argument("-m", type=int, default=24)
    ap.add_argument("--no-exact", action="store_true", help="skip the CP-SAT windows")
    ap.add_argument("--out", type=Path, help="write each best schedule as text here")
    args = ap.parse_args()
    print(f"p = {args.p}, m = {args.m}; times in ms, peak activation in GB (worst rank); "
          f"memory limit = the chain-1F1B baseline's peak")
    print(f"{'preset':<18} {'best schedule (layout, knobs)':<58} {'time':>9} {'bubble':>7} "
          f"{'peak':>7} {'1F1B t':>9} {'bubble':>7} {'peak':>7} {'speedup':>8} "
          f"{'search':>6}  (< {TARGET_S:.0f} s)")
    for name in PRESETS:
        print(_row(name, args.p, args.m, not args.no_exact, args.out))


if __name__ == "__main__":
    main()
