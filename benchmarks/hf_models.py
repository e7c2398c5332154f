"""Hugging Face models through FlexPipe, fast and predicted: GPT-2 (its own ``Conv1D``) and a
Llama, exported by torch.export and cut into stages, trained on 2 gloo ranks with 1F1B, ZB-H1
and ZB-V. Per model it prints W's deferred share per stage (the trainable weight elements whose
gradient W computes), each schedule's median step time relative to 1F1B's (median over rounds,
the schedules alternating within each round), the simulator's predicted makespan from the
profiled costs against the measured one, and the activation peak per rank, predicted vs
measured.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_models.py --quick   # ~10 min, 2 cores
    PYTHONPATH=benchmarks .venv/bin/python benchmarks/hf_models.py --rounds 5 --steps 6
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.cost.model import CostModel
from flexpipe.demo.verdict import op_time_ratio
from flexpipe.ir.lower import lower
from flexpipe.runtime.execution.wgrad import WeightWork, recording
from flexpipe.runtime.execution.wsplit import prepare, recorded_share
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.measurement.profile import profile
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.runtime.user.tracing import split_points
from flexpipe.sim.engine import simulate
from flexpipe.specs import load

HIDDEN, LAYERS, HEADS, SEQ, VOCAB, MICRO = 256, 4, 4, 64, 2048, 4
SCHEDULES = ("1f1b", "zb-h1", "zb-v")
PREFIX = {"gpt2": "model.transformer.h.", "llama": "model.model.layers."}


class Logits(nn.Module):
    """A causal LM as ``ids -> logits``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.model = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def _lm(name: str) -> nn.Module:
    """GPT-2 or Llama at hidden 256 (dropout 0, untied embeddings), float32."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return Logits(GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)))
    from transformers import LlamaConfig, LlamaForCausalLM

    return Logits(LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=SEQ, tie_word_embeddings=False)))


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return fn.cross_entropy(logits.flatten(0, 1), target.flatten())


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]


def _points(name: str, stages: int) -> tuple[str, ...]:
    per = LAYERS // stages
    return tuple(f"{PREFIX[name]}{k * per}" for k in range(1, stages))


def _user(name: str, stages: int) -> flexpipe.UserModel:
    x, y = _batch(0)
    return flexpipe.UserModel(_lm(name), _loss, ((x,), y), split_points=_points(name, stages))


def gpt2_2() -> flexpipe.UserModel:
    """GPT-2 cut into 2 stages (``--model hf_models:gpt2_2``)."""
    return _user("gpt2", 2)


def gpt2_4() -> flexpipe.UserModel:
    """GPT-2 cut into 4 stages (ZB-V)."""
    return _user("gpt2", 4)


def llama_2() -> flexpipe.UserModel:
    """Llama cut into 2 stages."""
    return _user("llama", 2)


def llama_4() -> flexpipe.UserModel:
    """Llama cut into 4 stages (ZB-V)."""
    return _user("llama", 4)


def shares(name: str, stages: int) -> list[float]:
    """W's deferred share of every stage: one recorded forward of one micro-batch."""
    x, _ = _batch(0)
    traced = split_points(_lm(name), _points(name, stages), (x,))
    outs: dict[str, tuple[torch.Tensor, ...]] = {}
    out = []
    for seg in traced.segments:
        stage = prepare(seg.layers[0])
        flat = (x,) if not seg.after else tuple(t for p in seg.after for t in outs[p])
        work = WeightWork()
        with recording(work):
            outs[seg.name] = stage(*(t.detach().requires_grad_(t.is_floating_point())
                                     for t in flat))
        out.append(recorded_share(stage, work))
    return out


def _job(name: str, schedule: str, m: int, steps: int) -> tuple[Job, ModelSpec]:
    stages = 4 if schedule == "zb-v" else 2
    spec = ModelSpec("user", factory=f"hf_models:{name}_{stages}")
    return Job(load(schedule, 2, m), spec, TrainConfig(steps=steps, measure_memory=True)), spec


def measure(name: str, schedule: str, m: int, steps: int) -> dict[str, Any]:
    """One launch of ``steps`` steps: median step (ms), measured makespan and activation
    peaks of the last step."""
    job, _ = _job(name, schedule, m, steps)
    sched = job.schedule  # on the model's stage graph: skip edges carry the masks from stage 0
    ranks = launch([job], world=2)[0]
    step_ms = statistics.median(t for r in ranks for t in r.step_times[1:]) * 1e3
    steps_ms = [max(ts) * 1e3 for ts in zip(*(r.step_times[1:] for r in ranks), strict=True)]
    trace = measured_trace(sched, ranks)
    got = trace.metrics()
    return {"step_ms": step_ms, "best_ms": min(steps_ms), "makespan": got.makespan,
            "peaks": list(got.peak_activation), "trace": trace}


def predict(name: str, schedule: str, m: int, costs: dict[Any, CostModel]) -> dict[str, Any]:
    """The simulator's makespan and activation peaks from the profiled costs, one profile per
    placement (1F1B and ZB-H1 share theirs, so their ranking is the schedules', not noise's)."""
    job, spec = _job(name, schedule, m, 1)
    sched = job.schedule
    key = sched.placement.stage_rank
    if key not in costs:
        costs[key] = profile(spec, sched.placement)
    trace = simulate(lower(sched), costs[key])
    want = trace.metrics()
    return {"pred_makespan": want.makespan, "pred_peaks": list(want.peak_activation),
            "costs": costs[key], "pred_trace": trace}


def report(name: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Print one model's table."""
    print(f"\n{name} (hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, micro-batch {MICRO})")
    for k in (2, 4):
        print(f"  deferred share per stage ({k} stages): "
              + " ".join(f"{s:.3f}" for s in shares(name, k)))
    for sched in ("1f1b", "zb-v"):
        print(f"  profiled ms per stage, F/B/W/BW ({sched}'s placement): " + ", ".join(
            "/".join(f"{c.times[k]:.1f}" for k in ("F", "B", "W", "BW"))
            for c in runs[sched][0]["costs"].stages))
    base = statistics.median(r["step_ms"] for r in runs["1f1b"])
    best = min(r["best_ms"] for r in runs["1f1b"])
    for sched, rs in runs.items():
        med, low = statistics.median(r["step_ms"] for r in rs), min(r["best_ms"] for r in rs)
        first, span = rs[0], statistics.median(r["makespan"] for r in rs)
        err = 100 * (first["pred_makespan"] - span) / span
        ops = statistics.median(op_time_ratio(r["pred_trace"], r["trace"]) or 0.0 for r in rs)
        peaks = ", ".join(f"rank {i}: {p / 2**20:.2f} vs {q / 2**20:.2f} MiB "
                          f"({100 * (p - q) / q:+.1f}%)"
                          for i, (p, q) in enumerate(zip(first["pred_peaks"], first["peaks"],
                                                         strict=True)))
        print(f"  {sched:6s} step {med:7.1f} ms (best {low:.1f})  speed vs 1F1B "
              f"{base / med:.3f}x (best {best / low:.3f}x)  makespan predicted "
              f"{first['pred_makespan']:.1f} vs measured {span:.1f} ms ({err:+.1f}%; compute "
              f"ops {ops:.2f}x profiled)  activation peak predicted vs measured: {peaks}")
    rank = {"median": lambda s: statistics.median(r["step_ms"] for r in runs[s]),
            "best": lambda s: min(r["best_ms"] for r in runs[s]),
            "predicted": lambda s: runs[s][0]["pred_makespan"]}
    print("  ranking " + "; ".join(f"{k} {' < '.join(sorted(runs, key=f))}"
                                   for k, f in rank.items()))


def machine_load() -> str:
    """The machine's load averages (1, 5, 15 min) and core count, as ``uptime`` gives them."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    """Parse, run every model and schedule in alternating rounds, print the tables."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="3 rounds of 4 steps, m = 4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=list(PREFIX))
    args = ap.parse_args(argv)
    rounds, steps, m = (3, 4, 4) if args.quick else (args.rounds, args.steps, args.m)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    print(f"{' '.join(sys.argv)}: {rounds} rounds of {steps} steps, m = {m}, 2 gloo ranks; "
          f"at the start {machine_load()}")
    for name in args.models:
        costs: dict[Any, CostModel] = {}
        preds = {sched: predict(name, sched, m, costs) for sched in SCHEDULES}
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
        for k in range(rounds):
            for sched in SCHEDULES:
                runs[sched].append(measure(name, sched, m, steps) | preds[sched])
                print(f"  {name} round {k} {sched}: {runs[sched][-1]['step_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
        report(name, runs)
    print(f"\nat the end {machine_load()}; {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
