"""Exactness on one GPU: the CUDA paths of the runtime (NCCL process group, compute, the B/W
split, recompute and the random numbers of dropout) train as the CPU reference does.

One rank over NCCL (p = 1, m = 4, GPT of 4 blocks, float64):
1. dropout 0.2 with a run seed: 1F1B with recompute, ZB-H1, ZB-V and V-Half against 1F1B
   (gradients and parameters after 2 steps);
2. dropout 0.2 without a seed: 1F1B with recompute against 1F1B, bit for bit (the recompute
   replays its forward's CUDA generator state), and against the seeded run (dropout acts);
3. no dropout: 1F1B, ZB-H1 and ZB-V on the GPU against single-device training on the CPU.

    python benchmarks/gpu_exact.py          # on a machine with a GPU
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace

import torch

from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig
from flexpipe.schedules import registry

GPT = ModelSpec("gpt", layers=4, hidden=64, heads=2, vocab=64, seq=16, micro_batch=2,
                dtype="float64", dropout=0.2)
SEEDED = TrainConfig(steps=2, capture=True, timeout_s=120, seed=7)
SPLIT = ("1f1b", "1f1b-recompute", "zb-h1", "zb-v", "v-half")
PLAIN = ("1f1b", "zb-h1", "zb-v")
M = 4


def _cpu(ranks: list[RankResult], what: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in by_name(ranks, what).items()}


def _error(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> str:
    return f"{worst_relative_error(got, want)[1]:.2e}"


def main() -> None:
    """Print the three checks."""
    os.environ.setdefault("FLEXPIPE_BACKEND", "nccl")
    plain = replace(GPT, dropout=0.0)
    jobs = [Job(registry.build(n, 1, M), GPT, SEEDED) for n in SPLIT]
    jobs += [Job(registry.build(n, 1, M), GPT, replace(SEEDED, seed=None))
             for n in ("1f1b", "1f1b-recompute")]
    jobs += [Job(registry.build(n, 1, M), plain, SEEDED) for n in PLAIN]
    runs = launch(jobs, 1, timeout_s=300)
    grads = [_cpu(r, "grads") for r in runs]
    params = [_cpu(r, "params") for r in runs]
    print(f"backend {os.environ['FLEXPIPE_BACKEND']}; worst relative error, gradients / "
          "parameters after 2 steps")
    for i, name in enumerate(SPLIT[1:], 1):
        print(f"1. dropout, seeded: {name} vs 1f1b: {_error(grads[i], grads[0])} / "
              f"{_error(params[i], params[0])}")
    k = len(SPLIT)
    same = all(torch.equal(grads[k][n], grads[k + 1][n]) for n in grads[k])
    print(f"2. dropout, unseeded: 1f1b-recompute equals 1f1b bit for bit: {same} (unseeded vs "
          f"seeded 1f1b: {_error(grads[k], grads[0])}, dropout acts)")
    ref = reference_run(plain, SEEDED, M)
    want_g = {n: t.cpu() for n, t in ref.grads.items()}
    want_p = {n: t.cpu() for n, t in ref.params.items()}
    for j, name in enumerate(PLAIN):
        i = k + 2 + j
        print(f"3. no dropout: {name} vs single device on the CPU: {_error(grads[i], want_g)} / "
              f"{_error(params[i], want_p)}")


if __name__ == "__main__":
    main()
