"""Profile -> simulate -> run: the measured step time of the built-in GPT at 2 ranks (gloo,
CPU) against the simulator's prediction from the profiled cost model, for 1F1B and ZB-V.
Target: within 15%.

    .venv/bin/python benchmarks/profile_predict.py [--steps 6] [--hidden 256]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from flexpipe.cost.model import CostModel
from flexpipe.ir.lower import lower
from flexpipe.runtime.measurement.measure import measured_trace, median
from flexpipe.runtime.measurement.profile import profile
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.schedules import registry
from flexpipe.sim.engine import simulate


def in_mb_units(cost: CostModel) -> CostModel:
    """The cost with activation memory in units of M_B (the generators' memory limits are in
    those units; the profile measures bytes): rank 0's per-micro-batch activation is 1/v."""
    unit = max(st.act for st in cost.stages) * len(cost.stages) / cost.comm.num_ranks
    stages = tuple(replace(st, act=st.act / unit, wact=st.wact / unit, input=st.input / unit)
                   for st in cost.stages)
    return replace(cost, stages=stages)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,zb-v")
    args = parser.parse_args()
    p = 2
    model = ModelSpec("gpt", layers=args.layers, hidden=args.hidden, heads=8, vocab=512,
                      seq=128, micro_batch=4)
    train = TrainConfig(steps=args.steps, optimizer="adamw", lr=1e-4)
    print(f"GPT: {args.layers} blocks, hidden {args.hidden}, seq 128, micro-batch 4, "
          f"m={args.microbatches}, p={p}, gloo on CPU, 1 thread per rank")
    print(f"{'schedule':<10}{'predicted ms':>14}{'measured ms':>13}{'step ms':>10}"
          f"{'error':>9}{'pred bubble':>13}{'meas bubble':>13}")
    for name in args.schedules.split(","):
        schedule = registry.build(name, p, args.microbatches)
        cost = profile(model, schedule.placement)
        if registry.library()[name].cost_aware:
            schedule = registry.build(name, p, args.microbatches, cost=in_mb_units(cost))
        predicted = simulate(lower(schedule), cost).metrics()
        ranks = launch([Job(schedule, model, train)], p)[0]
        measured = measured_trace(schedule, ranks).metrics()
        step = median([max(r.step_times[k] for r in ranks) for k in range(1, args.steps)])
        err = (1e3 * step - predicted.makespan) / predicted.makespan
        print(f"{name:<10}{predicted.makespan:>14.1f}{measured.makespan:>13.1f}"
              f"{1e3 * step:>10.1f}{100 * err:>8.1f}%{predicted.bubble_rate:>13.3f}"
              f"{measured.bubble_rate:>13.3f}")
    print("measured = makespan of the last step's trace; step = median wall time of a whole "
          "step (with optimizer); error = median step vs predicted makespan")


if __name__ == "__main__":
    main()
