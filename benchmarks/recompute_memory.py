"""Selective recompute's activation memory, predicted against measured, per model and policy:
the built-in GPT (its attention cores), a user's ``nn.Module`` and the tiny Hugging Face GPT-2
(``tests/runtime/sr_models.py``) under the ``flexpipe.Recompute`` policies drop MLP, keep
attention (drop the blocks but their attention), every 2nd block, and a per-op policy that
saves the matrix products of the blocks (torchtitan's op-level SAC). Each is cut into 2
stages and trained one step of m = 4 on 2 gloo ranks under 1F1B and ZB-H1 with an SR before
every backward (``with_recompute``), all the jobs in one launch. The prediction is the
simulator's activation peak per rank from the memory check's cost model (one forward of each
stage measured in full and as SR runs it: ``sr_act`` / ``sr_act_w``, what SR keeps; unit
times); the measurement counts the live tensors after every op of the run. Per row: both
peaks of the worse rank, their ratio, and the peak without recompute.

    PYTHONPATH=src:tests/runtime .venv/bin/python benchmarks/recompute_memory.py
        [--models gpt net gpt2] [--schedules 1f1b zb-h1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "runtime"))

import sr_models as sm  # noqa: E402

from flexpipe.ir.lower import lower  # noqa: E402
from flexpipe.runtime.measurement.measure import measured_trace  # noqa: E402
from flexpipe.runtime.measurement.memory_check import memory_cost  # noqa: E402
from flexpipe.runtime.models.spec import ModelSpec  # noqa: E402
from flexpipe.runtime.processes.launch import launch  # noqa: E402
from flexpipe.runtime.processes.train import Job, TrainConfig  # noqa: E402
from flexpipe.schedules.recompute import with_recompute  # noqa: E402
from flexpipe.sim.engine import simulate  # noqa: E402
from flexpipe.specs import load  # noqa: E402

RANKS, M = 2, 4
GPT = ModelSpec("gpt", layers=4, hidden=64, seq=32, micro_batch=4)
POLICIES = {"gpt": ("none", "attention cores")} | {m: tuple(p) for m, p in sm.POLICIES.items()}


def job(model: str, policy: str, schedule: str) -> Job:
    """One metered step of ``model`` under ``policy`` (SR before each backward unless none)."""
    sched = load(schedule, RANKS, M)
    if policy != "none":
        sched = with_recompute(sched)
    spec = GPT if model == "gpt" else ModelSpec("user", factory=sm.factory(model, policy))
    return Job(sched, spec, TrainConfig(steps=1, measure_memory=True))


def predicted(item: Job) -> list[float]:
    """The simulated activation peak of each rank, from the measured sizes."""
    return list(simulate(lower(item.schedule), memory_cost(item)).metrics().peak_activation)


def main() -> None:
    """Print one row per model, policy and schedule, then the worst ratio."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    args = ap.parse_args()
    t0 = time.perf_counter()
    keys = [(m, p, s) for m in args.models for p in POLICIES[m] for s in args.schedules]
    jobs = [job(*key) for key in keys]
    want = [predicted(j) for j in jobs]
    got = [list(measured_trace(j.schedule, r).metrics().peak_activation)
           for j, r in zip(jobs, launch(jobs, RANKS), strict=True)]
    plain = {(m, s): g for (m, p, s), g in zip(keys, got, strict=True) if p == "none"}
    print(f"activation peak (KiB), predicted vs measured: {RANKS} gloo ranks, m = {M}, one "
          "step, SR before every backward; the rank whose ratio is furthest from 1")
    print(f"{'model':<6}{'policy':<18}{'schedule':<9}{'predicted':>10}{'measured':>10}"
          f"{'ratio':>8}{'no recompute':>14}")
    worst = 1.0
    for (m, p, s), w, g in zip(keys, want, got, strict=True):
        r = max(range(RANKS), key=lambda i: abs(w[i] / g[i] - 1))
        ratio = w[r] / g[r]
        worst = max(worst, ratio, 1 / ratio)
        base = plain[(m, s)][r] if (m, s) in plain else None
        print(f"{m:<6}{p:<18}{s:<9}{w[r] / 1024:>10.1f}{g[r] / 1024:>10.1f}{ratio:>8.3f}"
              f"{'-' if base is None else f'{base / 1024:.1f}':>14}", flush=True)
    print(f"worst ratio {worst:.3f} over {len(keys)} cases in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
