"""The transport's pair-order check over the library, the graph presets and searched schedules:
for every library schedule at p = 2..8 (v = 2 where it takes chunks, m = 2p), every layout of
every graph preset (list-scheduled with fused and split backward) and the schedules the
automated scheduler keeps at unit costs (memory limits p and 2p M_B, m = 2p): the channels
(ordered rank pairs) that carry messages, the messages, how many channels receive in another
order than their sender sends (matched all the same: the receiver posts in the sender's
order), how many violations are left after lowering (target 0: no one-sided message, and
posting cannot deadlock) and how many messages a message back proves consumed before the step's
end (``flexpipe.ir.consumed``: their sent tensors are let go then, not at the end).

    .venv/bin/python benchmarks/pair_order.py [--p 2 3 4 5 6 7 8] [--graph-p 2 4 8]
        [--search-p 2 4 8]
"""

from __future__ import annotations

import argparse
import time

from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.graphs import PRESETS, preset_layouts
from flexpipe.ir.consumed import proofs
from flexpipe.ir.lower import lower
from flexpipe.ir.pairs import transfers
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules import registry
from flexpipe.search.engine import search
from flexpipe.sim.pairs import pair_violations

POLICIES = {"fused": Policy(prefer=("B", "F"), split=False),
            "split": Policy(prefer=("B", "F", "W"), split=True)}


Row = tuple[str, int, int, int, int, int]


def _row(label: str, schedule: Schedule) -> Row:
    lowered = lower(schedule)
    t = transfers(lowered)
    crossing = sum(t.sent[ch] != t.received.get(ch) for ch in t.sent)
    left = len(pair_violations(lowered))
    proven = sum(len(proofs(lowered, t, r)) for r in range(lowered.num_ranks))
    return label, len(t.channels()), sum(map(len, t.sent.values())), crossing, left, proven


def _library(ps: list[int]) -> list[Row]:
    rows = []
    for name in registry.names():
        params = dict(registry.library()[name].params)
        for p in ps:
            schedule = registry.build(name, p, 2 * p, **({"v": 2} if "v" in params else {}))
            rows.append(_row(f"{name} p={p}", schedule))
    return rows


def _graphs(ps: list[int]) -> list[Row]:
    rows = []
    for name in PRESETS:
        for p in ps:
            for gm in preset_layouts(name, p):
                for pol_name, pol in POLICIES.items():
                    schedule = policy_schedule(gm.placement, 2 * p, pol, gm.cost, gm.graph)
                    rows.append(_row(f"{name}/{gm.layout} {pol_name} p={p}", schedule))
    return rows


def _searched(ps: list[int]) -> list[Row]:
    rows = []
    for p in ps:
        for limit in (p, 2 * p):
            result = search(None, p, 2 * p, float(limit), max_candidates=200)
            for trial in result.trials:
                if trial.schedule is not None:
                    rows.append(_row(f"search mem={limit} p={p}: {trial.label[:18]}",
                                     trial.schedule))
    return rows


def main() -> None:
    """Print the table and the totals."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--p", type=int, nargs="+", default=list(range(2, 9)))
    ap.add_argument("--graph-p", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--search-p", type=int, nargs="+", default=[2, 4, 8])
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = _library(args.p) + _graphs(args.graph_p) + _searched(args.search_p)
    print(f"{'schedule':<50}{'channels':>9}{'messages':>10}{'crossing':>10}{'after':>7}"
          f"{'proven':>8}")
    for label, channels, messages, crossing, left, proven in rows:
        print(f"{label:<50}{channels:>9}{messages:>10}{crossing:>10}{left:>7}{proven:>8}")
    bad = sum(r[4] for r in rows)
    crossing = sum(1 for r in rows if r[3])
    proven, messages = sum(r[5] for r in rows), sum(r[2] for r in rows)
    print(f"{len(rows)} schedules; {crossing} receive in another order than sent on some "
          f"channel (matched in the sender's order); {bad} violations after lowering; "
          f"{proven} of {messages} messages proven consumed before the step's end "
          f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
