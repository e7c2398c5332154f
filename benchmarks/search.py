"""The automated scheduler (``flexpipe.search``) against published numbers and the library.

1. Zero-bubble paper Table 9 times at the ZB-1p (p M_B) and ZB-2p (2p M_B) limits: the bubble
   rate found vs the paper's Table 5 (target: at most the published value + 0.002). M_W = M_B/2
   (the zero-bubble code's mem_f = 2, mem_w = -1). "linear" is the best on one stage per rank.
2. Unit costs, p in {4, 6, 8}, m = 2p, limits 1/3 .. 1 of 1F1B's peak: search vs the best of
   V-Min, V-Half, V-ZB, ZB-H1 and 1F1B that fits.
3. Tiny instances: CP-SAT's proven optimum vs the heuristic search's best.
4. Uneven stages (first 1.5x, last 2x): search vs the best fixed library schedule.
5. Search time over the full space: unit costs, and the 1.5B Table 9 times (profiled costs) at
   1F1B's memory (p M_B), p = 32 m = 128 (target <= 10 s) and p = 64 m = 256 (<= 60 s).
6. Scale table: p = 16, 32, 64, m = 2p, 4p, 8p, 1.5B times at p M_B: seconds, bubble, makespan.
7. Makespan (the default objective) at p = 4 against torch's ZBVZeroBubble order, 1.5B times,
   under that order's memory (needs torch).
8. ``--dominance``: the pruning rules' evidence: the search with ``prune=False`` (every
   candidate built) beside the default one, on Table 9's cells and p = 16: same best.

Bubble rate: 1 - useful work / (p x largest per-rank span) (``flexpipe.sim.trace``), docs/facts.md's
definition when every rank does the same work; times in ms for the Table 9 rows, memory in M_B.

    .venv/bin/python benchmarks/search.py [--quick | --table9 | --timing | --scale | --dominance
                                           | --torch]
"""

from __future__ import annotations

import argparse
import os
import time

from flexpipe.cost import CostModel
from flexpipe.cost.model import Comm, StageCost
from flexpipe.search import search

TABLE9 = {"1.5B": (8, 24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433),
          "6.2B": (8, 24, 29.718, 29.444, 19.927, 0.527, 0.1323, 0.0029),
          "14.6B": (16, 48, 11.347, 11.248, 8.132, 0.377, 0.1397, 0.0066),
          "28.3B": (32, 96, 10.419, 10.207, 7.715, 0.408, 0.1421, 0.0038)}
REFERENCE = ("v-min", "v-half", "v-zb", "zb-h1", "1f1b")
FITS = ("best", "slower")


def _best(result, pick) -> object:  # type: ignore[no-untyped-def]
    done = [t for t in result.trials if t.status in FITS and pick(t)]
    return min(done, key=lambda t: t.span, default=None)


def table9() -> None:
    """Section 1."""
    print("\n1. Table 9 times: bubble rate found vs ZB-1p / ZB-2p (target <= published + 0.002);"
          "\n   M_W = M_B/2; the paper's values are on the linear placement, 'found' on the best"
          " placement searched (column 'on'), 'linear' the best of a search on the linear"
          " placement alone")
    print(f"{'model':<6} {'limit':>6} {'paper':>7} {'found':>7} {'on':>8} {'linear':>7} "
          f"{'met':>4} {'time s':>7}  best candidate")
    for name, (p, m, f, b, w, comm, zb1, zb2) in TABLE9.items():
        cost = CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=0.5, comm=comm)
        for factor, paper in ((1, zb1), (2, zb2)):
            res = search(cost, p, m, factor * p, objective="span")  # Table 5: span-based
            best = res.best_trial
            lin = _best(search(cost, p, m, factor * p, placements=("linear",), objective="span"),
                        lambda t: t.placement == "linear")
            ok = "yes" if best.bubble_rate <= paper + 0.002 else "NO"
            print(f"{name:<6} {f'{factor}p':>6} {paper:>7.4f} {best.bubble_rate:>7.4f} "
                  f"{best.placement:>8} {lin.bubble_rate:>7.4f} {ok:>4} {res.seconds:>7.1f}  "
                  f"{best.label}")


def unit_sweep() -> None:
    """Section 2."""
    print("\n2. Unit costs, M_W = M_B, m = 2p: search bubble (any placement) vs best fitting of "
          + ", ".join(REFERENCE) + " (V placement; ZB-H1, 1F1B linear)")
    print(f"{'p':>3} {'limit':>7} {'search':>7} {'library':>8}  best candidate")
    for p in (4, 6, 8):
        for sixths in range(2, 7):
            limit = p * sixths / 6
            res = search(None, p, 2 * p, limit, objective="span")
            ref = _best(res, lambda t: t.family in REFERENCE)
            found = "-" if res.best_trial is None else f"{res.best_trial.bubble_rate:.4f}"
            lib = "-" if ref is None else f"{ref.bubble_rate:.4f}"
            label = res.best_trial.label if res.best_trial else "(nothing fits)"
            print(f"{p:>3} {limit:>7.3f} {found:>7} {lib:>8}  {label}")


def exact_tiny() -> None:
    """Section 3."""
    print("\n3. Tiny instances, unit costs: CP-SAT optimum (best candidate's placement) vs "
          "heuristic")
    print(f"{'p':>2} {'m':>2} {'limit':>5} {'status':>8} {'optimum':>8} {'heuristic':>9} "
          f"{'gap':>6} {'solve s':>7}  placement")
    for p, m, limit in ((2, 4, 2.0), (3, 6, 3.0), (4, 6, 4.0), (4, 6, 2.0), (4, 4, 4.0)):
        heur = search(None, p, m, limit, objective="span")  # CP-SAT minimises the span
        res = search(None, p, m, limit, exact=True, time_limit=30, objective="span")
        ex = res.exact or {}
        opt = ex.get("objective")
        gap = heur.best_trial.span / opt - 1 if opt else float("nan")
        print(f"{p:>2} {m:>2} {limit:>5g} {ex.get('status', '-'):>8} {opt or 0:>8.4g} "
              f"{heur.best_trial.span:>9.4g} {gap:>6.1%} {ex.get('seconds', 0):>7.1f}  "
              f"{heur.best_trial.placement}")


def uneven(p: int) -> CostModel:
    """First stage 1.5x, last stage 2x, others unit."""
    def stage(k: float) -> StageCost:
        return StageCost({"F": k, "B": k, "W": k}, act=1.0, wact=1.0)

    return CostModel((stage(1.5),) + (stage(1.0),) * (p - 2) + (stage(2.0),),
                     Comm.uniform(p, 0.0))


def uneven_table() -> None:
    """Section 4."""
    print("\n4. Uneven stages (first 1.5x, last 2x), m = 2p: span of search vs best library")
    print(f"{'p':>3} {'limit':>6} {'search':>8} {'library':>8} {'speedup':>8}  search / library")
    for p in (4, 8, 16):
        for limit in (p / 2, float(p), 2.0 * p):
            res = search(uneven(p), p, 2 * p, limit, objective="span")
            lib = _best(res, lambda t: t.family not in ("policy", "exact"))
            best = res.best_trial
            if best is None or lib is None:
                print(f"{p:>3} {limit:>6g}  (nothing fits)")
                continue
            print(f"{p:>3} {limit:>6g} {best.span:>8.4g} {lib.span:>8.4g} "
                  f"{lib.span / best.span:>7.3f}x  {best.label} / {lib.label}")


def timing() -> None:
    """Section 5."""
    print("\n5. Search time, full space (library + synthesis); load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for times, p, m, limit in (("unit", 32, 128, 32.0), ("unit", 32, 128, 16.0),
                               ("1.5B", 32, 128, 32.0), ("1.5B", 64, 256, 64.0)):
        cost = None if times == "unit" else table9_cost(p)
        t0, c0 = time.perf_counter(), time.process_time()
        res = search(cost, p, m, limit)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        best = res.best_trial
        print(f"{times:<5} p={p} m={m} limit={limit:g}: {dt:.1f} s ({cpu:.1f} s CPU), "
              f"{len(res.trials)} candidates "
              f"{res.counts()}, best {best.label} bubble {best.bubble_rate:.4f} makespan "
              f"{best.makespan:.1f}")


def table9_cost(p: int) -> CostModel:
    """The 1.5B row's times on p ranks, M_W = M_B / 2."""
    _, _, f, b, w, comm, _, _ = TABLE9["1.5B"]
    return CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=0.5, comm=comm)


def scale() -> None:
    """Section 6."""
    print("\n6. Scale, 1.5B times at p M_B (1F1B's memory), default objective (makespan); load "
          f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'p':>3} {'m':>4} {'seconds':>8} {'CPU s':>7} {'bubble':>7} {'makespan':>10}  best")
    for p in (16, 32, 64):
        for m in (2 * p, 4 * p, 8 * p):
            t0, c0 = time.perf_counter(), time.process_time()
            res = search(table9_cost(p), p, m, float(p))
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            best = res.best_trial
            print(f"{p:>3} {m:>4} {dt:>8.1f} {cpu:>7.1f} {best.bubble_rate:>7.4f} "
                  f"{best.makespan:>10.1f}  {best.label}", flush=True)


def versus_torch() -> None:
    """Section 7."""
    from flexpipe.search import fit_cost
    from flexpipe.sim import simulate
    from flexpipe.specs import load

    print("\n7. Makespan at p = 4 vs torch's ZBVZeroBubble order (1.5B times, its peak memory)")
    print(f"{'m':>3} {'torch':>9} {'search':>9} {'span obj.':>9}  best")
    p = 4
    for m in (8, 12, 16):
        cost = table9_cost(p)
        order = load("torch:zbv", p, m)
        met = simulate(order, fit_cost(cost, order.num_stages)).metrics()
        peak = max(met.peak_activation)
        res = search(cost, p, m, peak)
        span = search(cost, p, m, peak, objective="span")
        print(f"{m:>3} {met.makespan:>9.3f} {res.best_trial.makespan:>9.3f} "
              f"{span.best_trial.makespan:>9.3f}  {res.best_trial.label}")


def dominance() -> None:
    """Section 8."""
    print("\n8. Pruning rules (search.bounds): best with every candidate built vs pruned")
    print(f"{'case':<16} {'limit':>6} {'full':>10} {'pruned':>10} {'full s':>7} {'pruned s':>8}"
          f"  {'same':>4}  best")
    cases = [(name, p, m, row) for name, (p, m, *row) in TABLE9.items()]
    cases.append(("1.5B p=16", 16, 64, list(TABLE9["1.5B"][2:])))
    for name, p, m, (f, b, w, comm, *_rest) in cases:
        cost = CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=0.5, comm=comm)
        for factor in (1, 2):
            t0 = time.perf_counter()
            full = search(cost, p, m, factor * p, prune=False)
            t1 = time.perf_counter()
            pruned = search(cost, p, m, factor * p)
            t2 = time.perf_counter()
            a, b_ = full.best_trial.makespan, pruned.best_trial.makespan
            print(f"{name:<16} {factor * p:>6} {a:>10.3f} {b_:>10.3f} {t1 - t0:>7.1f} "
                  f"{t2 - t1:>8.1f}  {'yes' if b_ <= a + 1e-9 else 'NO':>4}  "
                  f"{pruned.best_trial.label}", flush=True)


def main() -> None:
    """Print every section (``--quick`` skips the slow ones; the flags pick one section)."""
    parser = argparse.ArgumentParser()
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_true", help="sections 2 and 4 only")
    group.add_argument("--scale", action="store_true", help="section 6 only")
    group.add_argument("--dominance", action="store_true", help="section 8 only")
    group.add_argument("--torch", action="store_true", help="section 7 only")
    group.add_argument("--timing", action="store_true", help="section 5 only")
    group.add_argument("--table9", action="store_true", help="section 1 only")
    args = parser.parse_args()
    picked = {"quick": (unit_sweep, uneven_table), "scale": (scale,),
              "dominance": (dominance,), "torch": (versus_torch,), "timing": (timing,),
              "table9": (table9,)}
    sections = next((v for k, v in picked.items() if getattr(args, k)),
                    (table9, unit_sweep, exact_tiny, uneven_table, timing, scale, versus_torch))
    for section in sections:
        section()


if __name__ == "__main__":
    main()
