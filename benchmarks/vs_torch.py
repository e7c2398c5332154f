"""FlexPipe vs torch.distributed.pipelining: the same GPT, the same schedule (1F1B, interleaved
1F1B with v=2, ZB-V), 2 ranks on gloo (CPU), in alternating rounds; prints the median step
time of each (best round), the ratio FlexPipe / torch of those (target <= 1.0) and each round's
ratio, which shows the machine's run-to-run noise.

    .venv/bin/python benchmarks/vs_torch.py [--steps 5] [--hidden 128]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pp

from flexpipe.runtime.execution.segments import build_stages
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.measurement.measure import median
from flexpipe.runtime.models.kinds import build_model, make_batch
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch, launch_task
from flexpipe.runtime.processes.train import Job, TrainConfig, make_optimizer
from flexpipe.schedules import registry

# FlexPipe library name -> (torch schedule class name, chunks per rank, V placement)
SCHEDULES = {"1f1b": ("Schedule1F1B", 1, False),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, False),
             "zb-v": ("ScheduleZBVZeroBubble", 2, True)}


class Plain(nn.Module):
    """A FlexPipe stage that returns a bare tensor when it has one output (torch's stages
    expect that)."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, *xs: torch.Tensor) -> Any:
        """Run the stage."""
        out = self.stage(*xs)
        return out[0] if len(out) == 1 else out


def torch_task(rank: int, world: int, model: ModelSpec, name: str, m: int,
               steps: int) -> list[float]:
    """Launch task: train with torch.distributed.pipelining; step times (s)."""
    cls, v, vshape = SCHEDULES[name]
    num = world * v
    mine = [rank, 2 * world - 1 - rank] if vshape else [c * world + rank for c in range(v)]
    layers, loss_fn = build_model(model)
    stages = build_stages(layers, None, num, keep=mine)
    pstages = [pp.PipelineStage(Plain(stages[s]), s, num, torch.device("cpu")) for s in mine]
    sched_cls = getattr(pp, cls)
    sched = sched_cls(pstages[0] if v == 1 else pstages, m, loss_fn=loss_fn)
    opt = make_optimizer([p for s in stages.values() for p in s.parameters()],
                         TrainConfig(optimizer="adamw", lr=1e-4))
    times = []
    for step in range(steps):
        batch = make_batch(model, step, m)
        x = torch.cat([b[0][0] for b in batch])
        y = torch.cat([b[1] for b in batch])
        opt.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        args = (x,) if 0 in mine else ()
        kwargs = {"target": y} if num - 1 in mine else {}
        sched.step(*args, **kwargs)
        opt.step()
        times.append(time.perf_counter() - t0)
    return [times]  # type: ignore[list-item]


def _step(times_per_rank: list[list[float]]) -> float:
    steps = len(times_per_rank[0])
    return median([max(t[k] for t in times_per_rank) for k in range(1, steps)])


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each")
    args = parser.parse_args()
    p, m = 2, args.microbatches
    model = ModelSpec("gpt", layers=args.layers, hidden=args.hidden, heads=8, vocab=512,
                      seq=64, micro_batch=4)
    train = TrainConfig(steps=args.steps, optimizer="adamw", lr=1e-4)
    print(f"GPT: {args.layers} blocks, hidden {args.hidden}, seq 64, micro-batch 4, m={m}, "
          f"p={p}, gloo on CPU, torch {torch.__version__}")
    print(f"{'schedule':<18}{'FlexPipe ms':>13}{'torch ms':>11}{'ratio':>8}  per-round ratios")
    for name, (_, v, _) in SCHEDULES.items():
        params = {"v": v} if "v" in dict(registry.library()[name].params) else {}
        schedule = registry.build(name, p, m, **params)
        ours, theirs = [], []
        for _ in range(args.rounds):  # alternate, keep each one's best (the machine is shared)
            ranks = launch([Job(schedule, model, train)], p)[0]
            ours.append(_step([r.step_times for r in ranks]))
            theirs.append(_step([r[0] for r in launch_task(
                torch_task, (model, name, m, args.steps), p)]))
        rounds = " ".join(f"{a / b:.3f}" for a, b in zip(ours, theirs, strict=True))
        print(f"{name:<18}{1e3 * min(ours):>13.1f}{1e3 * min(theirs):>11.1f}"
              f"{min(ours) / min(theirs):>8.3f}  {rounds}")


if __name__ == "__main__":
    main()
