"""FlexPipe against the zero-bubble authors' reference values (issue 16's anchor table): the V
family, ZB-V and the linear placement at the anchors' memory, and the search's unit-cost
memory/bubble frontier against the adaptive-V curve.

Conventions: bubble rate = (span - m (T_F + T_B + T_W)) / span (the ZB definition), m = 3p.
"unit": T_F = T_B = T_W = 1 per rank, no communication; "1.5B" etc.: the zero-bubble paper's
Table 9 times per rank (each V chunk half of them) with its T_comm. Memory in M_B (one
micro-batch's activation on a rank). Memory model: M_W = M_B for the V family and the frontier
(B frees nothing until W); M_W = M_B / 2 (the paper's Table 9 setting) for the "limit 2p" rows.
Placement: V (rank i holds stages i and 2p-1-i) unless the row says linear.

Adaptive-V curve (authors' units: M chunk activations, 1F1B = 2p; b idle chunk-pass slots):
b(M) = 3p - 1 - 3M + max(3p, p + 1 + 2 ceil(M/2)) for p <= M <= 2p, bubble rate b / (6m + b).

    .venv/bin/python benchmarks/anchors.py [--no-frontier | --timing | --cells]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

from flexpipe.cost import CostModel
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules import registry
from flexpipe.search import search
from flexpipe.sim import simulate

TIMES = {"unit": (1.0, 1.0, 1.0, 0.0), "1.5B": (18.522, 18.086, 9.337, 0.601),
         "6.2B": (29.718, 29.444, 19.927, 0.527), "14.6B": (11.347, 11.248, 8.132, 0.377),
         "28.3B": (10.419, 10.207, 7.715, 0.408)}
P_OF = {"1.5B": 8, "6.2B": 8, "14.6B": 16, "28.3B": 32}
EPS = 5e-5  # anchors are printed to 4 decimals


def v_cost(times: str, p: int, wact: float = 1.0) -> CostModel:
    """Per-rank times on the V placement (each chunk half), act = M_B, wact = M_W."""
    f, b, w, comm = TIMES[times]
    return CostModel.per_rank(Placement.vshape(p).stage_rank, p, f=f, b=b, w=w, comm=comm,
                              wact=wact)


def linear_cost(times: str, p: int, wact: float) -> CostModel:
    f, b, w, comm = TIMES[times]
    return CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=wact, comm=comm)


def adaptive_curve(p: int, chunks: int, m: int) -> float:
    """The authors' adaptive-V bubble rate at ``chunks`` chunk activations (module docstring)."""
    b = 3 * p - 1 - 3 * chunks + max(3 * p, p + 1 + 2 * math.ceil(chunks / 2))
    return b / (6 * m + b)


def _library(name: str, times: str, p: int) -> tuple[float, float]:
    cost = v_cost(times, p)
    sched = registry.build(name, p, 3 * p, cost=cost)
    return _measure(sched, cost, cost.stage(0).act * 2)


def _measure(sched: Schedule, cost: CostModel, mb: float) -> tuple[float, float]:
    met = simulate(sched, cost).metrics()
    return met.bubble_rate, max(met.peak_activation) / mb


def _search(times: str, p: int, factor: int, placement: str) -> tuple[float, float]:
    """The search's best at factor x p M_B (M_W = M_B / 2) on one placement kind."""
    cost = linear_cost(times, p, 0.5)
    res = search(cost, p, 3 * p, factor * p, objective="span",  # the anchors are bubble rates
                 placements=("linear",) if placement == "linear" else None)
    fits = [t for t in res.trials if t.status in ("best", "slower") and t.span is not None
            and (t.placement == "linear") == (placement == "linear")]
    best = min(fits, key=lambda t: t.span or 0.0)
    return best.bubble_rate or 0.0, (best.peak or 0.0)


Row = tuple[str, str, float, Callable[[], tuple[float, float]]]


def rows() -> list[Row]:
    """(case, memory in M_B, anchor, FlexPipe's (bubble rate, peak M_B))."""
    out: list[Row] = []
    for p, mem, anchor in ((4, "3 (2.5)", 0.0649), (6, "4", 0.0924), (8, "5", 0.1056),
                           (16, "9", 0.1246)):
        out.append((f"V-Half, unit, p={p}", mem, anchor, lambda p=p: _library("v-half", "unit", p)))
    for p, anchor in ((8, 0.1702), (16, 0.1902)):
        out.append((f"V-Half, 1.5B, p={p}", str((p + 2) // 2), anchor,
                     lambda p=p: _library("v-half", "1.5B", p)))
    out.append(("V-Min, unit, p=6", "3", 0.1360, lambda: _library("v-min", "unit", 6)))
    out.append(("V-Min, 1.5B, p=8", "4", 0.2993, lambda: _library("v-min", "1.5B", 8)))
    for p, anchor in ((8, 0.0739), (16, 0.0788)):
        out.append((f"V-ZB, 1.5B, p={p}", str(p), anchor, lambda p=p: _library("v-zb", "1.5B", p)))
    for model, anchor in (("1.5B", 0.0703), ("6.2B", 0.0403), ("14.6B", 0.0498),
                          ("28.3B", 0.0531)):
        p = P_OF[model]
        out.append((f"ZB-V, {model}, limit p", str(p), anchor,
                     lambda model=model, p=p: _library("zb-v", model, p)))
    out.append(("ZB-V (search, V), 1.5B, limit 2p, M_W=M_B/2", "16", 0.0076,
                lambda: _search("1.5B", 8, 2, "vshape")))
    for model, anchor in (("1.5B", 0.0433), ("28.3B", 0.0038)):
        p = P_OF[model]
        out.append((f"search, linear, {model}, limit 2p, M_W=M_B/2", str(2 * p), anchor,
                     lambda model=model, p=p: _search(model, p, 2, "linear")))
    return out


def anchor_table() -> int:
    """Print the anchor table; returns how many cells are above their anchor."""
    print("Anchor cells (m = 3p, bubble rate; memory in M_B; V placement unless 'linear')")
    print(f"{'case':<46} {'memory':>8} {'FlexPipe':>9} {'peak':>6} {'anchor':>8} "
          f"{'at or below':>12} {'s':>6}")
    above = 0
    for case, mem, anchor, fn in rows():
        t0 = time.perf_counter()
        rate, peak = fn()
        ok = rate <= anchor + EPS
        above += not ok
        print(f"{case:<46} {mem:>8} {rate:>9.4f} {peak:>6.2f} {anchor:>8.4f} "
              f"{'yes' if ok else 'NO':>12} {time.perf_counter() - t0:>6.1f}")
    return above


def frontier() -> int:
    """The search's unit-cost frontier (V and linear placements, M_W = M_B) against the
    adaptive-V curve; returns how many points are above it."""
    print("\nSearch frontier, unit costs, M_W = M_B, m = 3p, vs the adaptive-V curve b(M)")
    print(f"{'p':>3} {'limit M_B':>9} {'search':>8} {'adaptive V':>11} {'at or below':>12} "
          f"{'monotone':>9} {'s':>6}  best candidate")
    above = 0
    for p in (4, 6, 8):
        last = math.inf
        for eighths in (4, 5, 6, 7, 8):
            limit = p * eighths / 8
            t0 = time.perf_counter()
            res = search(None, p, 3 * p, limit, objective="span")  # bubble rates
            best = res.best_trial
            rate = best.bubble_rate if best and best.bubble_rate is not None else math.inf
            ref = adaptive_curve(p, int(math.floor(2 * limit + 1e-9)), 3 * p)
            ok = rate <= ref + EPS
            above += not ok
            mono = "yes" if rate <= last + 1e-12 else "NO"
            last = min(last, rate)
            label = best.label if best else "(nothing fits)"
            print(f"{p:>3} {limit:>9g} {rate:>8.4f} {ref:>11.4f} {'yes' if ok else 'NO':>12} "
                  f"{mono:>9} {time.perf_counter() - t0:>6.1f}  {label}")
    return above


def cells() -> int:
    """Issue 30's cells above p = 8: p = 10, 12, unit and 1.5B times, m = 3p, M_W = M_B, every
    whole M_B from V-Half's memory to 1F1B's: the search (span objective) vs the building-block
    scheduler called directly (which reaches the authors' values) and the unit-cost curve;
    returns how many cells are above ``v_blocks``."""
    from flexpipe.schedules.vblocks import v_blocks
    from flexpipe.search import fit_cost

    print("\nCells above p = 8 (m = 3p, M_W = M_B, bubble rate): search vs v_blocks direct")
    print(f"{'p':>3} {'times':<5} {'M_B':>4} {'search':>8} {'v_blocks':>9} {'curve':>7} "
          f"{'at or below':>12} {'monotone':>9} {'s':>6}  best candidate")
    above = 0
    for p in (10, 12):
        for times in ("unit", "1.5B"):
            cost = linear_cost(times, p, 1.0)
            last = math.inf
            for mem in range((p + 2) // 2, p + 1):
                t0 = time.perf_counter()
                best = search(cost, p, 3 * p, float(mem), objective="span").best_trial
                dt = time.perf_counter() - t0
                fitted = fit_cost(cost, 2 * p)
                direct = simulate(v_blocks(p, 3 * p, fitted, float(mem)),
                                  fitted).metrics().bubble_rate
                rate = best.bubble_rate if best and best.bubble_rate is not None else math.inf
                ok = rate <= direct + EPS
                above += not ok
                mono = "yes" if rate <= last + 1e-12 else "NO"
                last = min(last, rate)
                print(f"{p:>3} {times:<5} {mem:>4} {rate:>8.4f} {direct:>9.4f} "
                      f"{adaptive_curve(p, 2 * mem, 3 * p):>7.4f} {'yes' if ok else 'NO':>12} "
                      f"{mono:>9} {dt:>6.1f}  {best.label if best else '-'}", flush=True)
    return above


def blocks_timing() -> None:
    """Seconds of one ``v_blocks`` call (cold cache) with the 1.5B times at V-Min's, V-Half's
    and 1F1B's memory."""
    from flexpipe.schedules import vblocks

    print("\nAdaptive V by building blocks (v_blocks), 1.5B times, m = 3p, cold cache: seconds")
    print(f"{'p':>3} {'V-Min mem':>10} {'V-Half mem':>11} {'1F1B mem':>9}")
    for p in (8, 16):
        secs = []
        for mem in ((p + 4) // 3, (p + 2) // 2, p):
            vblocks.clear_caches()
            cost = v_cost("1.5B", p)
            t0 = time.perf_counter()
            vblocks.v_blocks(p, 3 * p, cost, mem * 2 * cost.stage(0).act)
            secs.append(time.perf_counter() - t0)
        print(f"{p:>3} {secs[0]:>10.1f} {secs[1]:>11.1f} {secs[2]:>9.1f}")


def main() -> None:
    """Print the anchor table and the frontier."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-frontier", action="store_true", help="the anchor table only")
    ap.add_argument("--timing", action="store_true",
                    help="only the seconds of adaptive V by building blocks")
    ap.add_argument("--cells", action="store_true", help="only the cells at p = 10 and 12")
    args = ap.parse_args()
    if args.timing:
        blocks_timing()
        return
    if args.cells:
        print(f"\ncells above v_blocks: {cells()}")
        return
    above = anchor_table()
    if not args.no_frontier:
        above += frontier()
    print(f"\ncells above their anchor: {above}")


if __name__ == "__main__":
    main()
