"""Gradient reduction behind compute against one all-reduce after the step: the built-in GPT at
pp 2 x dp 2 on 4 gloo processes, per schedule, both ways side by side in one launch (step k of
each in turn, so the machine's drift reaches both alike).

Per schedule: the median step time (the slowest rank's, reduction included) with the reduction
after the step and overlapped; the after-step reduction's own time (the slowest rank's); the
share of it the overlap hides, (after - overlapped) / reduction; and the simulator's overlapped
step (``flexpipe.sim.reduce``) from the after-step run's measured op times and each rank's
measured reduction time.

    .venv/bin/python benchmarks/grad_overlap.py [--schedules 1f1b,zb-h1,zb-v] [--steps 8]
        [--hidden 256] [--layers 8] [--seq 64] [--micro-batch-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import flexpipe
from flexpipe.runtime.models.gpt import GPTConfig, gpt_layers, lm_loss
from flexpipe.sim.reduce import reduce_step
from flexpipe.sim.trace import Trace

DP, M = 2, 4


def _slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _pipe(name: str, cfg: GPTConfig, overlap: bool) -> Any:
    torch.manual_seed(0)
    return flexpipe.pipeline(gpt_layers(cfg), name, loss_fn=lm_loss, m=M, dp=DP,
                             overlap_reduce=overlap)


def _batch(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
    """This rank's micro-batches of ``x``, ``y`` as ``Pipeline.step`` cuts them."""
    return pipe._batch(x if pipe.needs_inputs else None, y if pipe.needs_targets else None,
                       True)


def _step(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One timed step: (the slowest rank's step, this rank's after-step reduction or 0)."""
    for p in pipe.parameters():
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    pipe.worker.run(_batch(pipe, x, y))
    t1 = time.perf_counter()
    pipe.worker.reduce_gradients()
    t2 = time.perf_counter()
    return _slowest(t2 - t0), t2 - t1


def bench(names: list[str], cfg: GPTConfig, steps: int, mb: int) -> list[dict[str, float]]:
    """Every rank: one row per schedule."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (mb * M * DP, cfg.seq + 1), generator=gen)
    rows = []
    for name in names:
        pipes = {False: _pipe(name, cfg, False), True: _pipe(name, cfg, True)}
        r = pipes[False].replica
        x, y = ids[:, :-1].chunk(DP)[r], ids[:, 1:].chunk(DP)[r]
        times: dict[bool, list[float]] = {False: [], True: []}
        reduce_s: list[float] = []
        for k in range(steps + 1):
            for overlap in (False, True):
                step, red = _step(pipes[overlap], x, y)
                if k:  # the first step warms up
                    times[overlap].append(step)
                    if not overlap:
                        reduce_s.append(_slowest(red))
        ops = _op_times(pipes[False], x, y)
        rows.append({"after": statistics.median(times[False]),
                     "overlapped": statistics.median(times[True]),
                     "reduce": statistics.median(reduce_s),
                     "predicted": _predict(pipes[False], ops, statistics.median(reduce_s))})
    return rows


def _op_times(pipe: Any, x: torch.Tensor, y: torch.Tensor) -> list[Any]:
    """Every pipeline rank's measured op starts and ends of one after-step run (replica 0)."""
    out = pipe.worker.run(_batch(pipe, x, y))
    pipe.worker.reduce_gradients()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (pipe.worker.pipe_rank, pipe.replica, out.starts, out.ends))
    return [e for e in every if e[1] == 0]


def _predict(pipe: Any, ops: list[Any], reduce: float) -> float:
    """The overlapped step the simulator gives from the measured op times (each stage's share
    of its rank's reduction by its parameters)."""
    schedule = pipe.worker.executor.schedule
    by_rank = {r: (s, e) for r, _, s, e in ops}
    trace = Trace(schedule, tuple(tuple(by_rank[r][0]) for r in range(schedule.num_ranks)),
                  tuple(tuple(by_rank[r][1]) for r in range(schedule.num_ranks)), ((), ()),
                  "measured")
    stages = schedule.placement.rank_stages[pipe.worker.pipe_rank]
    sizes = {s: sum(p.numel() for p in pipe.stages[s].parameters()) for s in stages}
    mine = {s: reduce * n / max(1, sum(sizes.values())) for s, n in sizes.items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    cost = {s: t for part in every for s, t in part.items()}
    return reduce_step(trace, cost).overlapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-h1,zb-v")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    args = parser.parse_args()
    cfg = GPTConfig(vocab=512, hidden=args.hidden, heads=4, layers=args.layers, seq=args.seq)
    names = args.schedules.split(",")
    rows = flexpipe.spawn(bench, 4, names, cfg, args.steps, args.micro_batch_size,
                          deadline_s=3000.0)[0]
    print(f"GPT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
          f"micro-batch {args.micro_batch_size}, m {M}; pp 2 x dp {DP}, gloo, float32")
    print(f"{'schedule':<10} {'after ms':>9} {'overlap ms':>11} {'ratio':>6} "
          f"{'reduce ms':>10} {'hidden':>7} {'predicted ms':>13} {'pred err':>9}")
    for name, row in zip(names, rows, strict=True):
        ratio = row["overlapped"] / row["after"]
        hidden = (row["after"] - row["overlapped"]) / row["reduce"] if row["reduce"] else 0.0
        err = row["predicted"] / row["overlapped"] - 1
        print(f"{name:<10} {1e3 * row['after']:>9.1f} {1e3 * row['overlapped']:>11.1f} "
              f"{ratio:>6.2f} {1e3 * row['reduce']:>10.1f} {hidden:>7.0%} "
              f"{1e3 * row['predicted']:>13.1f} {err:>+9.0%}")


if __name__ == "__main__":
    main()
