"""DualPipeV with its F&B pairs run at once against the same order run one pass after the
other, DualPipe (the two-way schedule: two copies of the model, m / 2 micro-batches each way,
the same m in all) both ways too, ZB-V and 1F1B: a mixture of experts at pp 2 x ep 2 on 4 gloo
processes, in one launch (step k of each schedule in turn, so the machine's drift reaches all
alike). Each step is timed from its first op to its last (the gradient reduction after it
apart: DualPipe's sum of its two copies over each pair of ranks, the replicas' average).
DualPipe and 1F1B cut the model in two even halves, the V schedules each half in two again
(``split_counts``), so that each of their two stages is two of the V's stages.

Per schedule: the median step time (the slowest rank's); for DualPipeV the share of the
all-to-all time the overlap hides, (sequential - overlapped) / the step's all-to-all time (the
slowest rank's, every pass's time inside the exchanges, ``transport.exchange``, of the
sequential run); and the simulator's step against the measured one from two cost models
measured in these steps (``flexpipe.runtime.measurement.passes.step_cost``): each stage's F, B,
W and BW and their all-to-all parts (``F_COMM``, ``B_COMM``, ``BW_COMM``), and the share of
what a pair could hide that the overlapped run's pairs hid (``PAIR_HIDE``: two threads of one
gloo process share the host's cores and interpreter, so they hide less than a pair whose
exchanges run beside the compute). "From V": every schedule from the sequential DualPipeV
run's passes (its four stages merged in pairs for the two-stage schedules, ``fit_placement``);
"from own": each schedule from its own passes (DualPipe's from its sequential run and its
pairs' share from its overlapped one; 1F1B's fused backwards give B = BW, W = 0). Where the
two differ: DualPipe's prediction from its own passes with each group of keys (F, B and W, BW,
``PAIR_HIDE``) taken from the V's; how many ranks are inside a pass while one is (4 processes
on the 2 cores); and each sequential run's steps replayed with their passes' own times
(``flexpipe.sim.replay``), what the waits between the passes account for.

    .venv/bin/python benchmarks/dualpipe_overlap.py [--steps 6] [--hidden 256] [--experts 8]
        [--blocks 4] [--tokens 256] [--m 8] [--save DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import flexpipe
from flexpipe.cost.io import save_cost
from flexpipe.cost.model import CostModel
from flexpipe.ir.overlap import HIDE_SHARE
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.stage import even_partition
from flexpipe.runtime.measurement.passes import PASSES, step_cost
from flexpipe.runtime.models import moe
from flexpipe.runtime.transport import comm
from flexpipe.schedules.registry import build
from flexpipe.search.costs import fit_placement, split_counts
from flexpipe.sim.engine import simulate
from flexpipe.sim.replay import replay
from flexpipe.sim.trace import Trace

EP, VOCAB, TOP_K = 2, 512, 2
IN_TURN = " (in turn)"
RUNS = ("dualpipev", "dualpipev" + IN_TURN, "dualpipe", "dualpipe" + IN_TURN, "zb-v", "1f1b")
PROFILED = "dualpipev" + IN_TURN
"""The run whose measured passes give the common cost model (every kind of pass, run one at a
time)."""
OWN = {"dualpipev": (PROFILED, "dualpipev"), "dualpipe": ("dualpipe" + IN_TURN, "dualpipe"),
       "zb-v": ("zb-v", None), "1f1b": ("1f1b", None)}
"""Per schedule, the runs whose passes give its own cost model: (run one pass at a time, run
with the pairs at once or None)."""


def _size(args: argparse.Namespace) -> moe.MoESize:
    return moe.MoESize(VOCAB, args.hidden, args.experts, TOP_K, args.blocks)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _schedule(name: str) -> str:
    return name.removesuffix(IN_TURN)


def _counts(name: str, args: argparse.Namespace) -> list[int]:
    """Layers per stage: the even cut in two (DualPipe's model stages, 1F1B's), and the V's
    four stages each half cut in two, so that each of those is two V stages (the cost
    model's stages merged in pairs, ``fit_placement``) and each rank of the V holds what the
    even cut in four gives it."""
    halves = even_partition(args.blocks + 2, 2)
    return split_counts(halves, 2) if _schedule(name) in ("dualpipev", "zb-v") else halves


def _pipe(name: str, args: argparse.Namespace) -> Any:
    schedule = _schedule(name)
    m = args.m // 2 if schedule == "dualpipe" else args.m  # DualPipe: m / 2 each way, m in all
    return flexpipe.pipeline(moe.layers(_size(args)), schedule, loss_fn=moe.loss(_size(args)),
                             m=m, ep=EP, ep_plan=moe.PLAN, partition=_counts(name, args),
                             overlap_pairs=not name.endswith(IN_TURN))


def _batch(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    return pipe._batch(x if pipe.needs_inputs else None, y if pipe.needs_targets else None,
                       True)


def _step(pipe: Any, batch: Any) -> tuple[float, Any]:
    for p in pipe.parameters():
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    out = pipe.worker.run(batch)
    return _slowest(time.perf_counter() - t0), out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every rank: the median steps, the all-to-all time, the predictions."""
    torch.set_num_threads(1)  # 4 processes share the cores: one compute thread each
    pipes = {name: _pipe(name, args) for name in RUNS}
    gen = torch.Generator().manual_seed(1)
    seq = args.tokens // args.m
    ids = torch.randint(0, VOCAB, (args.m * EP, seq + 1), generator=gen)
    r = pipes["zb-v"].replica
    x, y = ids[:, :-1].chunk(EP)[r], ids[:, 1:].chunk(EP)[r]
    times: dict[str, list[float]] = {n: [] for n in RUNS}
    outs: dict[str, list[Any]] = {n: [] for n in RUNS}
    for k in range(args.steps + 1):
        for name in RUNS:
            took, out = _step(pipes[name], _batch(pipes[name], x, y))
            if k:
                times[name].append(took)
                outs[name].append(out)
    own = {s: _cost(pipes, outs, *runs) for s, runs in OWN.items()}
    a2a = [_slowest(sum(out.comm)) for out in outs[PROFILED]]
    measured = {n: statistics.median(times[n]) for n in RUNS}
    every = {n: _gathered(pipes[n], outs[n]) for n in RUNS}
    at_once = {n: _at_once(every[n]) for n in RUNS}
    replayed = {n: _replayed(pipes[n], every[n], own[_schedule(n)]) for n in RUNS
                if not pipes[n].worker.executor.schedule.overlaps or n.endswith(IN_TURN)}
    return {"measured": measured, "comm": statistics.median(a2a), "cost": own["dualpipev"],
            "at_once": at_once, "replayed": replayed,
            "own": own, "predicted": _predict(lambda name, sched: fit_placement(
                own["dualpipev"], sched.placement), args.m),
            "predicted_own": _predict(lambda name, sched: own[name], args.m),
            "swapped": _swapped(own["dualpipe"], own["dualpipev"], args.m), "concurrent":
            pipes["dualpipev"].worker.executor.pairs.concurrent_runs}


Gathered = Sequence[tuple[int, int, list[bool], list[Any]]]
"""Every rank's (pipeline rank, replica, which of its ops are passes, its steps' (starts,
ends))."""


def _gathered(pipe: Any, steps: Sequence[Any]) -> Gathered:
    """Collective: ``Gathered`` of ``pipe``'s ``steps``."""
    passes = [op.kind in PASSES for op in pipe.worker.executor.ops]
    mine = [(r.starts, r.ends) for r in steps]
    return comm.all_gather_object((pipe.pipe_rank, pipe.replica, passes, mine))


def _overlap(a: float, b: float, spans: Sequence[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in spans)


def _at_once(every: Gathered) -> float:
    """The mean number of ranks inside a pass (F, B, W, BW) while one is, over every rank's
    passes (``_gathered``; each rank's clock from its step's start, after a barrier), weighed
    by the passes' times: above 2, processes of the 2-core machine wait for a core."""
    weighted = total = 0.0
    for k in range(len(every[0][3])):
        spans = [[(st[i], en[i]) for i, is_pass in enumerate(passes) if is_pass]
                 for _, _, passes, (st, en) in ((*part[:3], part[3][k]) for part in every)]
        busy = [_union(rank) for rank in spans]
        for q, rank in enumerate(spans):
            for a, b in rank:
                weighted += (b - a) + sum(_overlap(a, b, busy[p]) for p in range(len(busy))
                                          if p != q)
                total += b - a
    return weighted / total if total else 0.0


def _union(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _replayed(pipe: Any, every: Gathered, cost: CostModel) -> tuple[float, float]:
    """Replica 0's steps (``_gathered``) replayed by the simulator with their passes' own
    measured times (``flexpipe.sim.replay``): the median (replayed, measured) makespans."""
    sched = pipe.worker.executor.schedule.flattened()
    mine = sorted((part for part in every if part[1] == 0), key=lambda part: part[0])
    got = []
    for k in range(len(mine[0][3])):
        trace = Trace(sched, tuple(tuple(part[3][k][0]) for part in mine),
                      tuple(tuple(part[3][k][1]) for part in mine), ((), ()), "measured")
        got.append((replay(trace, cost).metrics().makespan, trace.metrics().makespan))
    return statistics.median(g for g, _ in got), statistics.median(m for _, m in got)


def _cost(pipes: dict[str, Any], outs: dict[str, list[Any]], alone: str,
          paired: str | None) -> CostModel:
    """Collective: the cost model of the passes of run ``alone`` (and the pairs' share hidden
    in run ``paired``, the same order with the pairs at once)."""
    ops = pipes[alone].worker.executor.ops
    hide = None if paired is None else (pipes[paired].worker.executor.pairs.heads, outs[paired])
    return step_cost(ops, outs[alone], 2, hide)


SWAPS = {"F": ("F", "F_COMM"), "B, W": ("B", "B_COMM", "W", "W_COMM"), "BW": ("BW", "BW_COMM"),
         HIDE_SHARE: (HIDE_SHARE,)}
"""The groups of keys ``_swapped`` takes from the V's passes one group at a time."""


def _swapped(own: CostModel, v: CostModel, m: int) -> dict[str, float]:
    """DualPipe's simulated step from its own passes with one group of keys (``SWAPS``) taken
    from the V's (``fit_placement``): what each part of the difference between the two
    predictions accounts for."""
    sched = build("dualpipe", 2, m // 2)
    fitted = fit_placement(v, sched.placement)
    out = {}
    for group, keys in SWAPS.items():
        stages = tuple(replace(o, times={**o.times, **{k: f.times[k] for k in keys
                                                       if k in f.times and k in o.times}})
                       for o, f in zip(own.stages, fitted.stages, strict=True))
        out[group] = simulate(sched, CostModel(stages, own.comm)).metrics().makespan
    return out


def _through(cost: CostModel, two_way: bool) -> float:
    """One micro-batch's F + BW through the whole model: the stages' sum (DualPipe's two
    copies: half of it)."""
    total = sum(st.time("F") + st.time("BW") for st in cost.stages)
    return total / 2 if two_way else total


def _predict(cost: Callable[[str, Schedule], CostModel], m: int) -> dict[str, float]:
    """The simulator's step of every run from ``cost(schedule name, schedule)`` (from the V's
    four stages: 1F1B's two and DualPipe's two model stages are those merged in pairs along
    the chain, ``fit_placement``)."""
    out = {}
    for name in RUNS:
        schedule = _schedule(name)
        sched = build(schedule, 2, m // 2 if schedule == "dualpipe" else m)
        sched = sched.flattened() if name.endswith(IN_TURN) else sched
        out[name] = simulate(sched, cost(schedule, sched)).metrics().makespan
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per replica per step")
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--save", type=Path, help="a folder to write each schedule's own "
                        "cost model to (NAME.json, a cost file)")
    args = parser.parse_args()
    out = flexpipe.spawn(bench, 4, args, deadline_s=3000.0)[0]
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
        for name, cost in out["own"].items():
            save_cost(cost, args.save / f"{name}.json")
    print(f"MoE: hidden {args.hidden}, {args.experts} experts top-{TOP_K}, {args.blocks} "
          f"blocks, {args.tokens} tokens per replica, m {args.m}; pp 2 x ep {EP}, gloo, float32")
    seq, dual = out["measured"]["dualpipev (in turn)"], out["measured"]["dualpipev"]
    print(f"all-to-all per step (slowest rank, in turn): {1e3 * out['comm']:.1f} ms; hidden by "
          f"the overlap: {(seq - dual) / out['comm']:.0%}; pairs run at once on rank 0: "
          f"{out['concurrent']}")
    print(f"post per transfer: {1e3 * out['cost'].comm.post:.2f} ms")
    for k, stage in enumerate(out["cost"].stages):
        print(f"stage {k} (ms): " + ", ".join(
            f"{key} {v:.2f}" if key == HIDE_SHARE else f"{key} {1e3 * v:.1f}"
            for key, v in sorted(stage.times.items())))
    for name, cost in out["own"].items():
        print(f"{name}'s own passes (ms): " + "; ".join(
            f"stage {k} F {1e3 * st.time('F'):.1f} BW {1e3 * st.time('BW'):.1f}"
            for k, st in enumerate(cost.stages)) + "; one micro-batch's F + BW through the "
            f"model {1e3 * _through(cost, name == 'dualpipe'):.1f}")
    print("ranks inside a pass while one is (4 processes, 2 cores): " + ", ".join(
        f"{name} {got:.2f}" for name, got in out["at_once"].items()))
    print("dualpipe from its own passes with the V's (ms): " + ", ".join(
        f"{group} {1e3 * got:.1f}" for group, got in out["swapped"].items()))
    print("replica 0's steps replayed with their passes' own times (median ms, replayed / "
          "measured): " + ", ".join(f"{name} {1e3 * got:.1f} / {1e3 * ran:.1f}"
                                    for name, (got, ran) in out["replayed"].items()))
    print(f"{'schedule':<20} {'step ms':>9} {'vs 1f1b':>8} {'from V ms':>10} {'err':>5} "
          f"{'from own ms':>12} {'err':>5}")
    for name in RUNS:
        got, pred, own = (out[k][name] for k in ("measured", "predicted", "predicted_own"))
        print(f"{name:<20} {1e3 * got:>9.1f} {got / out['measured']['1f1b']:>8.2f} "
              f"{1e3 * pred:>10.1f} {pred / got - 1:>+5.0%} {1e3 * own:>12.1f} "
              f"{own / got - 1:>+5.0%}")


if __name__ == "__main__":
    main()
