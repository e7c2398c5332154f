"""Gradient equality and step time on a chosen backend (gloo on CPU, or NCCL with one GPU per
rank): each schedule trains a small float64 GPT for 3 steps and is compared with the
single-process CPU run (largest relative error of the loss, of every first-step gradient and
of every parameter after 3 steps); then a float32 GPT's median step time.

    .venv/bin/python benchmarks/backend_equivalence.py --backend nccl -p 2 [--dp 1]
    .venv/bin/python benchmarks/backend_equivalence.py -p 2 --dp 2 --tp 2 \
        --schedules 1f1b,zb-h1,zb-v,zeropp        # 3D: 8 gloo ranks, FSDP2 and DTensor
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from rich.console import Console
from rich.table import Table

from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig
from flexpipe.runtime.transport import comm
from flexpipe.schedules import registry

SMALL = ModelSpec("gpt", layers=4, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2,
                  dtype="float64")
TIMED = {"nccl": ModelSpec("gpt", layers=8, hidden=512, heads=8, vocab=1024, seq=256,
                           micro_batch=8),
         "gloo": ModelSpec("gpt", layers=4, hidden=64, heads=4, vocab=256, seq=32,
                           micro_batch=4)}


def _build(name: str, p: int, m: int):  # noqa: ANN202
    params = dict(registry.library()[name].params)
    return registry.build(name, p, m, **({"v": 2} if "v" in params else {}))


def _rel(ranks: list[RankResult], attr: str, want: dict[str, torch.Tensor]) -> float:
    return worst_relative_error(by_name(ranks, attr), want)[1]


def main() -> None:
    """Run and print the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "auto"))
    ap.add_argument("-p", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--schedules", default="1f1b,zb-v,zeropp")
    args = ap.parse_args()
    os.environ[comm.BACKEND_ENV] = backend = comm.pick_backend(args.backend)
    p, m, names = args.p, 2 * args.p, args.schedules.split(",")
    train = TrainConfig(steps=3, capture=True, dp=args.dp, tp=args.tp, timeout_s=120)
    jobs = [Job(_build(n, p, m), SMALL, train) for n in names]
    timed = TIMED[backend]
    jobs.append(Job(_build("1f1b", p, m), timed, TrainConfig(steps=6, dp=args.dp, tp=args.tp,
                                                              timeout_s=120)))
    results = launch(jobs, p * args.dp * args.tp, timeout_s=120, threads=1)
    ref = reference_run(SMALL, train, m)
    table = Table(title=f"{backend}, p={p}, dp={args.dp}, tp={args.tp}, m={m}: vs one CPU "
                  "process")
    for col in ("schedule", "loss rel err", "grad rel err", "param rel err (3 steps)"):
        table.add_column(col)
    for name, ranks in zip(names, results, strict=False):
        loss = next(r.losses for r in ranks if r.losses[0] is not None)
        lerr = max(abs(a - b) / abs(b) for a, b in zip(loss, ref.losses, strict=True))
        table.add_row(name, f"{lerr:.2e}", f"{_rel(ranks, 'grads', ref.grads):.2e}",
                      f"{_rel(ranks, 'params', ref.params):.2e}")
    Console().print(table)
    times = results[-1][0].step_times[1:]
    print(f"GPT h={timed.hidden} layers={timed.layers} seq={timed.seq} mb={timed.micro_batch} "
          f"float32, 1f1b p={p} dp={args.dp} tp={args.tp} m={m}: median step "
          f"{1e3 * statistics.median(times):.1f} ms "
          f"({backend}, cuda available: {torch.cuda.is_available()})")


if __name__ == "__main__":
    main()
