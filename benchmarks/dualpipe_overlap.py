"""DualPipeV with its F&B pairs run at once against the same order run one pass after the
other, DualPipe (the two-way schedule: two copies of the model, m / 2 micro-batches each way,
the same m in all), ZB-V and 1F1B: a mixture of experts at pp 2 x ep 2 on 4 gloo processes, in
one launch (step k of each schedule in turn, so the machine's drift reaches all alike). Each
step is timed from its first op to its last (the gradient reduction after it apart: DualPipe's
sum of its two copies over each pair of ranks, the replicas' average).

Per schedule: the median step time (the slowest rank's); for DualPipeV the share of the
all-to-all time the overlap hides, (sequential - overlapped) / the step's all-to-all time (the
slowest rank's, every pass's time inside the exchanges, ``transport.exchange``, of the
sequential run); and the simulator's step against the measured one, from one cost model
measured in these steps (``flexpipe.runtime.measurement.passes.step_cost``): each stage's F, B,
W and BW and their all-to-all parts (``F_COMM``, ``B_COMM``, ``BW_COMM``) from the sequential
DualPipeV run, and the share of what a pair could hide that the overlapped run's pairs hid
(``PAIR_HIDE``: two threads of one gloo process share the host's cores and interpreter, so
they hide less than a pair whose exchanges run beside the compute).

    .venv/bin/python benchmarks/dualpipe_overlap.py [--steps 6] [--hidden 256] [--experts 8]
        [--blocks 4] [--tokens 256] [--m 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import flexpipe
from flexpipe.cost.model import CostModel
from flexpipe.ir.overlap import HIDE_SHARE
from flexpipe.runtime.measurement.passes import step_cost
from flexpipe.runtime.models import moe
from flexpipe.schedules.registry import build
from flexpipe.search import fit_cost
from flexpipe.search.costs import fit_placement
from flexpipe.sim.engine import simulate

EP, VOCAB, TOP_K = 2, 512, 2
RUNS = ("dualpipev", "dualpipev (in turn)", "dualpipe", "zb-v", "1f1b")
PROFILED = "dualpipev (in turn)"
"""The run whose measured passes give the cost model (every kind of pass, run one at a time)."""


def _size(args: argparse.Namespace) -> moe.MoESize:
    return moe.MoESize(VOCAB, args.hidden, args.experts, TOP_K, args.blocks)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _pipe(name: str, args: argparse.Namespace) -> Any:
    schedule = "dualpipev" if name.startswith("dualpipev") else name
    m = args.m // 2 if name == "dualpipe" else args.m  # DualPipe: m / 2 each way, m in all
    return flexpipe.pipeline(moe.layers(_size(args)), schedule, loss_fn=moe.loss(_size(args)),
                             m=m, ep=EP, ep_plan=moe.PLAN, overlap_pairs=name != PROFILED)


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
    ops = pipes[PROFILED].worker.executor.ops
    heads = pipes["dualpipev"].worker.executor.pairs.heads
    cost = step_cost(ops, outs[PROFILED], 2, (heads, outs["dualpipev"]))
    comm = [_slowest(sum(out.comm)) for out in outs[PROFILED]]
    measured = {n: statistics.median(times[n]) for n in RUNS}
    return {"measured": measured, "comm": statistics.median(comm), "cost": cost,
            "predicted": _predict(cost, args.m), "concurrent":
            pipes["dualpipev"].worker.executor.pairs.concurrent_runs}


def _predict(cost: CostModel, m: int) -> dict[str, float]:
    """The simulator's step of every run from ``cost`` (1F1B's two stages, and DualPipe's two
    model stages, are the V's four merged in pairs along the chain)."""
    dual, two_way = build("dualpipev", 2, m), build("dualpipe", 2, m // 2)
    return {"dualpipev": simulate(dual, cost).metrics().makespan,
            "dualpipev (in turn)": simulate(dual.flattened(), cost).metrics().makespan,
            "dualpipe": simulate(two_way, fit_placement(cost, two_way.placement))
            .metrics().makespan,
            "zb-v": simulate(build("zb-v", 2, m), cost).metrics().makespan,
            "1f1b": simulate(build("1f1b", 2, m), fit_cost(cost, 2)).metrics().makespan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per replica per step")
    parser.add_argument("--m", type=int, default=8)
    args = parser.parse_args()
    out = flexpipe.spawn(bench, 4, args, deadline_s=3000.0)[0]
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
    print(f"{'schedule':<20} {'step ms':>9} {'vs 1f1b':>8} {'predicted ms':>13} {'pred err':>9}")
    for name in RUNS:
        got, pred = out["measured"][name], out["predicted"][name]
        print(f"{name:<20} {1e3 * got:>9.1f} {got / out['measured']['1f1b']:>8.2f} "
              f"{1e3 * pred:>13.1f} {pred / got - 1:>+9.0%}")


if __name__ == "__main__":
    main()
