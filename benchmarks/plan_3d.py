"""The planner's (pp, dp, tp) choice against Megatron-style defaults on every cluster preset.

For each (topology, devices, model): the layout the planner chooses (pipeline stages x data
replicas x tensor-parallel degree, ``fsdp`` when the replicas shard their static memory), its
schedule and micro-batch size, its simulated step time (pipeline iteration with the
tensor-parallel all-reduces inside, plus the data-parallel collectives) and peak memory per
rank; the same for the Megatron-style default (tp = a node's devices where the links show
nodes, the fewest pipeline stages whose uniform split fits memory, dp the rest, 1F1B or
interleaved 1F1B with the faster micro-batch size that fits), the speedup, the single pipeline
over every device (today's planner, dp = tp = 1, at the sweep's effort) and the planning
seconds. Global batch 64, micro-batch sizes 1, 2, 4; every time is the simulator's.

    .venv/bin/python benchmarks/plan_3d.py [--quick]
"""

from __future__ import annotations

import time

from plan import table_main

from flexpipe.plan import cluster_preset, model_preset
from flexpipe.plan.choose3d import Row, megatron_3d, plan_3d

TOPOLOGIES = ("nodes", "pcie", "ring", "random", "mixed", "geo")
CASES = [(t, 16, m) for m in ("gpt-6.7b", "gpt-13b") for t in TOPOLOGIES]
QUICK = [("nodes", 8, "gpt-1.3b"), ("nodes", 16, "gpt-6.7b"), ("geo", 16, "gpt-6.7b")]
GB = 1e9
HEAD = (f"{'preset':<9} {'model':<8} {'chosen':<16} {'schedule':<14} {'b':>2} {'step ms':>8} "
        f"{'GB':>5} | {'megatron':<12} {'sched':<12} {'b':>2} {'step ms':>8} {'GB':>5} "
        f"{'x meg':>6} | {'1 pipe ms':>9} {'plan s':>7}")


def _layout(row: Row) -> str:
    lay = row.layout
    return f"{lay.pp}x{lay.dp}x{lay.tp}" + (" fsdp" if lay.sharded else "")


def row(topology: str, n: int, model_name: str) -> str:
    """One table row."""
    model, cluster = model_preset(model_name), cluster_preset(topology, n)
    t0 = time.perf_counter()
    got = plan_3d(model, cluster)
    seconds = time.perf_counter() - t0
    best, meg = got.best, megatron_3d(model, cluster)
    single = [r for r in got.rows if r.layout.dp == 1 and r.layout.tp == 1]
    one = f"{single[0].step_ms:.1f}" if single and single[0].fits else "-"
    b = best.outcome.candidate.b if best.outcome else 0
    text = (f"{topology + '-' + str(n):<9} {model_name:<8} {_layout(best):<16} "
            f"{best.schedule[:14]:<14} {b:>2} {best.step_ms:>8.1f} {best.peak / GB:>5.1f} | ")
    if meg is None or meg.outcome is None:
        text += f"{'does not fit':<12} {'':<12} {'':>2} {'':>8} {'':>5} {'':>6} | "
    else:
        text += (f"{_layout(meg):<12} {meg.schedule[:12]:<12} {meg.outcome.candidate.b:>2} "
                 f"{meg.step_ms:>8.1f} {meg.peak / GB:>5.1f} {meg.step_ms / best.step_ms:>6.2f} | ")
    return text + f"{one:>9} {seconds:>7.2f}"


def main() -> None:
    """Print the table."""
    table_main(__doc__, "(pp, dp, tp) chosen by the planner vs the Megatron-style default: "
               "simulated step ms and peak GB per rank (layout = pp x dp x tp)", HEAD, CASES,
               QUICK, row)

if __name__ == "__main__":
    main()
