"""bf16 mixed precision against float32 training on the CPU: the built-in GPT at 2 gloo ranks,
both runs side by side in one launch (step k of each in turn, so the machine's drift reaches
both alike), per schedule: the median step time, each rank's measured activation peak (the
live-tensor meter over the first step) and the one the simulator predicts from
``memory_cost`` (the stages measured computing as the run does), and each rank's predicted
static memory (weights, gradients, optimizer state; under bf16 also the compute copies) against
what it holds after its last step (``RankResult.static_bytes``).

A CPU without bfloat16 matrix units (AVX512-BF16 / AMX) computes bfloat16 products by
converting to float32, so bf16 steps may be slower there; the activation memory halves
either way (the loss's float32 logits apart).

    .venv/bin/python benchmarks/mixed_precision.py [--schedules 1f1b,zb-h1] [--steps 6]
        [--hidden 256] [--layers 4] [--seq 128] [--micro-batch-size 8]
"""

from __future__ import annotations

import argparse
import statistics

from flexpipe.ir.lower import lower
from flexpipe.runtime.execution.precision import BF16, MixedPrecision
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.measurement.memory_check import memory_cost
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.sim.engine import simulate
from flexpipe.specs import load

MIB = 2.0**20


def _job(schedule: str, mp: MixedPrecision | None, args: argparse.Namespace) -> Job:
    model = ModelSpec("gpt", layers=args.layers, hidden=args.hidden, heads=4, vocab=512,
                      seq=args.seq, micro_batch=args.micro_batch_size)
    return Job(load(schedule, 2, args.m), model,
               TrainConfig(steps=args.steps, optimizer="adamw", lr=1e-3, measure_memory=True,
                           mixed_precision=mp))


def _row(job: Job, ranks: list[object]) -> dict[str, object]:
    """The figures of one run (every rank's result)."""
    loss_rank = next(r for r in ranks if r.losses[0] is not None)  # type: ignore[attr-defined]
    times = loss_rank.step_times[1:]  # type: ignore[attr-defined]
    cost = memory_cost(job)
    predicted = simulate(lower(job.schedule), cost).metrics()
    static = [sum(cost.stage(s).params for s in job.schedule.placement.rank_stages[r])
              for r in range(job.schedule.num_ranks)]
    return {"step_ms": 1e3 * statistics.median(times),
            "act_measured": measured_trace(job.schedule, ranks).metrics().peak_activation,
            "act_predicted": predicted.peak_activation, "static_predicted": static,
            "static_measured": [r.static_bytes for r in ranks],  # type: ignore[attr-defined]
            "loss": loss_rank.losses[-1]}  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="1f1b,zb-h1")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("-m", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    args = parser.parse_args()
    for schedule in args.schedules.split(","):
        jobs = [_job(schedule, mp, args) for mp in (None, BF16)]
        results = launch(jobs, 2, interleave=True, timeout_s=300.0, deadline_s=3000.0)
        print(f"{schedule}: p=2 m={args.m} gpt hidden {args.hidden}, {args.layers} blocks, "
              f"seq {args.seq}, micro-batch {args.micro_batch_size}, AdamW")
        for name, job, ranks in zip(("fp32", "bf16"), jobs, results, strict=True):
            row = _row(job, ranks)
            acts = ", ".join(f"{m / MIB:.2f}/{p / MIB:.2f}" for m, p in
                             zip(row["act_measured"], row["act_predicted"], strict=True))  # type: ignore[call-overload]
            static = ", ".join(f"{m / MIB:.2f}/{p / MIB:.2f}" for m, p in
                               zip(row["static_measured"], row["static_predicted"], strict=True))  # type: ignore[call-overload]
            print(f"  {name}: median step {row['step_ms']:.1f} ms, last loss "
                  f"{row['loss']:.4f}; activation peak per rank measured/predicted MiB "
                  f"[{acts}]; static per rank measured/predicted MiB [{static}]")


if __name__ == "__main__":
    main()
