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
import statistics
import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
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


def measure(name: str, schedule: str, m: int, steps: int, predict: bool) -> dict[str, Any]:
    """One launch of ``steps`` steps: median step (ms), measured makespan and activation
    peaks; with ``predict`` the profiled prediction too."""
    stages = 4 if schedule == "zb-v" else 2
    sched = load(schedule, 2, m)
    spec = ModelSpec("user", factory=f"hf_models:{name}_{stages}")
    ranks = launch([Job(sched, spec, TrainConfig(steps=steps, measure_memory=True))],
                   world=2)[0]
    step_ms = statistics.median(t for r in ranks for t in r.step_times[1:]) * 1e3
    got = measured_trace(sched, ranks).metrics()
    res: dict[str, Any] = {"step_ms": step_ms, "makespan": got.makespan,
                           "peaks": list(got.peak_activation)}
    if predict:
        want = simulate(lower(sched), profile(spec, sched.placement)).metrics()
        res |= {"pred_makespan": want.makespan, "pred_peaks": list(want.peak_activation)}
    return res


def report(name: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    """Print one model's table."""
    print(f"\n{name} (hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, micro-batch {MICRO})")
    for k in (2, 4):
        print(f"  deferred share per stage ({k} stages): "
              + " ".join(f"{s:.3f}" for s in shares(name, k)))
    base = statistics.median(r["step_ms"] for r in runs["1f1b"])
    for sched, rs in runs.items():
        med = statistics.median(r["step_ms"] for r in rs)
        first = rs[0]
        err = 100 * (first["pred_makespan"] - first["makespan"]) / first["makespan"]
        peaks = ", ".join(f"rank {i}: {p / 2**20:.2f} vs {q / 2**20:.2f} MiB "
                          f"({100 * (p - q) / q:+.1f}%)"
                          for i, (p, q) in enumerate(zip(first["pred_peaks"], first["peaks"],
                                                         strict=True)))
        print(f"  {sched:6s} step {med:7.1f} ms  speed vs 1F1B {base / med:.3f}x  "
              f"makespan predicted {first['pred_makespan']:.1f} vs measured "
              f"{first['makespan']:.1f} ms ({err:+.1f}%)  activation peak predicted vs "
              f"measured: {peaks}")
    order = sorted(runs, key=lambda s: statistics.median(r["step_ms"] for r in runs[s]))
    pred = sorted(runs, key=lambda s: runs[s][0]["pred_makespan"])
    print(f"  ranking measured {' < '.join(order)}; predicted {' < '.join(pred)}")


def main(argv: list[str] | None = None) -> None:
    """Parse, run every model and schedule in alternating rounds, print the tables."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 rounds of 4 steps, m = 4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("-m", type=int, default=8)
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=list(PREFIX))
    args = ap.parse_args(argv)
    rounds, steps, m = (2, 4, 4) if args.quick else (args.rounds, args.steps, args.m)
    torch.set_num_threads(1)
    for name in args.models:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SCHEDULES}
        for k in range(rounds):
            for sched in SCHEDULES:
                runs[sched].append(measure(name, sched, m, steps, predict=k == 0))
                print(f"  {name} round {k} {sched}: {runs[sched][-1]['step_ms']:.1f} ms",
                      file=sys.stderr, flush=True)
        report(name, runs)


if __name__ == "__main__":
    main()
