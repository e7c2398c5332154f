"""The planner (``flexpipe.plan``) against its baselines on every topology preset.

For each (topology, devices, model): the planner's predicted iteration time, Megatron's (uniform
layer split, devices in index order, 1F1B), PipeDream's (dynamic programming that assumes uniform
link bandwidth, index order, 1F1B), the planner's speedups over both, its schedule and the
planning seconds; and the planner restricted to 1F1B ("1f1b-only"), which separates what the
partition and mapping gain from what the schedule gains. Every time is the simulator's, on the
real links. "bound" is a lower bound on any plan of whole layers (``iteration_bound``: some
device must run at least its share of the heavy layers) and "max x" = Megatron / bound, the most
any planner could gain over Megatron on that preset. The last rows plan 64 layers
(embedding + 62 blocks + head) onto 32 devices (target: under 10 s).

    .venv/bin/python benchmarks/plan.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from flexpipe.plan import Options, cluster_preset, megatron, model_preset, pipedream, plan
from flexpipe.plan.evaluate import iteration_bound

CASES = [("nodes", 16, "gpt-6.7b"), ("pcie", 16, "gpt-6.7b"), ("ring", 8, "gpt-1.3b"),
         ("ring", 16, "gpt-6.7b"), ("random", 8, "gpt-1.3b"), ("random", 16, "gpt-6.7b"),
         ("mixed", 16, "gpt-1.3b"), ("mixed", 16, "gpt-6.7b"), ("geo", 8, "gpt-1.3b"),
         ("geo", 16, "gpt-6.7b"), ("nodes", 32, "gpt-64l"), ("random", 32, "gpt-64l"),
         ("geo", 32, "gpt-64l")]
QUICK = [("nodes", 16, "gpt-6.7b"), ("random", 8, "gpt-1.3b"), ("mixed", 16, "gpt-6.7b"),
         ("geo", 16, "gpt-6.7b"), ("random", 32, "gpt-64l")]
HEAD = (f"{'preset':<10} {'model':<9} {'plan ms':>9} {'megatron':>9} {'pipedream':>9} "
        f"{'x meg':>6} {'x pd':>6} {'1f1b-only':>9} {'x meg':>6} {'bound':>8} {'max x':>6} "
        f"{'schedule':<16} {'b':>2} {'plan s':>7}")


def row(topology: str, n: int, model_name: str, seed: int = 0) -> str:
    """One table row."""
    model, cluster = model_preset(model_name), cluster_preset(topology, n, seed)
    t0 = time.perf_counter()
    got = plan(model, cluster)
    seconds = time.perf_counter() - t0
    meg, pd = megatron(model, cluster), pipedream(model, cluster)
    t = got.best.makespan
    only = plan(model, cluster, Options(families=("1f1b",), refine_seconds=0)).best.makespan
    bound = iteration_bound(model, cluster)

    def cell(out: object) -> tuple[str, str]:
        if out is None:
            return "-", "-"
        ms = out.makespan  # type: ignore[attr-defined]
        mark = "" if out.fits else "*"  # type: ignore[attr-defined]
        return f"{ms:.1f}{mark}", f"{ms / t:.2f}"

    (meg_ms, meg_x), (pd_ms, pd_x) = cell(meg), cell(pd)
    return (f"{topology + '-' + str(n):<10} {model_name:<9} {t:>9.1f} {meg_ms:>9} {pd_ms:>9} "
            f"{meg_x:>6} {pd_x:>6} {only:>9.1f} {_ratio(meg, only):>6} {bound:>8.1f} "
            f"{_ratio(meg, bound):>6} "
            f"{got.schedule_name[:16]:<16} {got.best.candidate.b:>2} "
            f"{seconds:>7.2f}")


def _ratio(base: object, t: float) -> str:
    return "-" if base is None else f"{base.makespan / t:.2f}"  # type: ignore[attr-defined]


def table_main(doc: str, title: str, head: str, cases: list[tuple[str, int, str]],
               quick: list[tuple[str, int, str]], row: Callable[[str, int, str], str]) -> None:
    """Print ``title``, ``head`` and one ``row(topology, devices, model)`` per case (the
    ``quick`` cases with ``--quick``); shared with ``plan_3d.py``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{len(quick)} rows only")
    args = parser.parse_args()
    print(title)
    print(head)
    print("-" * len(head))
    for topology, n, model_name in quick if args.quick else cases:
        print(row(topology, n, model_name), flush=True)


def main() -> None:
    """Print the table."""
    table_main(__doc__, "Planner vs baselines: predicted iteration time (ms, simulated; global "
               "batch 64, micro-batch sizes 1, 2, 4; * = baseline exceeds memory)", HEAD, CASES,
               QUICK, row)

if __name__ == "__main__":
    main()
