"""Activation memory of the backward split, measured from the live tensors.

1. Per stage: M_B (held after F: what autograd saved plus the output kept for B) and M_W (held
   after B until W) for two built-in GPT blocks and two ``nn.TransformerEncoderLayer``s, against
   what W provably needs: each weight's input and output gradient (counted with forward hooks,
   independently of the runtime).
2. A real step on 2 ranks (gloo): the worst rank's activation peak, measured after every op,
   relative to 1F1B's, next to the simulator's prediction from the profiled cost model.

    .venv/bin/python benchmarks/bw_memory.py [--hidden 128 512 1024] [--skip-step]
    python benchmarks/bw_memory.py --device cuda --dtype bfloat16 --hidden 2048 --seq 2048 \
        --heads 16 --layers 1 --batch 1 2 4 --skip-step   # a GPT-1.3B-sized layer on a GPU
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from bw_stages import KINDS, Where, add_arguments, attention_kernel, label, sample, where
from bw_stages import stage as bw_stage
from torch import nn

from flexpipe.cost.model import CostModel
from flexpipe.ir.lower import lower
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.measurement.profile import profile
from flexpipe.runtime.measurement.sizes import stage_memory
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.runtime.split import WeightWork, recording
from flexpipe.schedules import registry
from flexpipe.sim.engine import simulate

MIB = 2.0 ** 20
WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def w_needs(stage: nn.Module, x: torch.Tensor) -> float:
    """Bytes of every weight's input and output gradient (= output size) in one forward."""
    total = [0]

    def layer(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        total[0] += _bytes(args[0]) + _bytes(out)

    def attention(mod: nn.Module, args: tuple[torch.Tensor, ...], out: object) -> None:
        q = _bytes(args[0])
        total[0] += q + 3 * q + q + q  # in-projection (E -> 3E) and out-projection (E -> E)

    hooks = [m.register_forward_hook(attention if isinstance(m, nn.MultiheadAttention)
                                     else layer)
             for m in stage.modules()
             if type(m) in WEIGHTED or isinstance(m, nn.MultiheadAttention)]
    with torch.no_grad():
        stage(x)
    for h in hooks:
        h.remove()
    return float(total[0])


def allocator_sizes(stage: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """M_B and M_W read from the CUDA caching allocator instead of the live tensors: bytes
    allocated after F (the stage's input, as received, and output included) and after B until
    W (the input gradient and the gradients B computed excluded), over those before the input
    arrived. An independent check on a GPU."""
    params = [p for p in stage.parameters() if p.requires_grad]
    stage.zero_grad(set_to_none=True)
    work = WeightWork()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    xi = x.detach().clone().requires_grad_()
    with recording(work):
        outs = stage(xi)
    torch.cuda.synchronize()
    m_b = torch.cuda.memory_allocated() - base
    grads = [torch.ones_like(t) for t in outs]
    with work.backward_input():
        torch.autograd.backward(list(outs), grads, inputs=[xi, *params])
    made_in_b = [t.grad for t in (xi, *params) if t.grad is not None]
    del outs, grads, xi
    torch.cuda.synchronize()
    m_w = torch.cuda.memory_allocated() - base - sum(_bytes(g) for g in made_in_b)
    work.run()
    stage.zero_grad(set_to_none=True)
    return float(m_b), float(m_w)


def per_stage(widths: list[int], batches: list[int], seq: int, kinds: list[str],
              at: Where) -> None:
    """Print table 1 (on a GPU with the allocator's view beside the live tensors')."""
    cuda = at.cuda
    print(f"1. one micro-batch on one stage: seq {seq}, {at.describe()}")
    print(f"{'stage':<14}{'hidden':>7}{'batch':>6}{'M_B MiB':>10}{'M_W MiB':>10}{'M_W/M_B':>9}"
          f"{'W needs MiB':>13}{'M_W/needs':>11}" + (f"{'alloc M_W/M_B':>15}" if cuda else ""))
    for h in widths:
        for batch in batches:
            x = sample(batch, seq, h, at)
            for kind in kinds:
                stage = StageModule(list(bw_stage(kind, h, seq, at)), 1)
                with attention_kernel(kind):
                    need = w_needs(stage, x)
                    size = stage_memory(stage, (x,), None, False)
                    alloc = allocator_sizes(stage, x) if cuda else (1.0, 1.0)
                act, wact = size["act"], size["wact"]
                print(f"{label(kind, at):<14}{h:>7}{batch:>6}{act / MIB:>10.1f}{wact / MIB:>10.1f}"
                      f"{wact / act:>9.3f}{need / MIB:>13.1f}{wact / need:>11.3f}"
                      + (f"{alloc[1] / alloc[0]:>15.3f}" if cuda else ""), flush=True)
                del stage
    print("M_B, M_W: live saved tensors and kept outputs after F / after B; W needs: each "
          "weight's input and output gradient (forward hooks)"
          + ("; alloc: the same two read from torch.cuda.memory_allocated" if cuda else ""))


def in_mb_units(cost: CostModel) -> CostModel:
    """The cost with activation memory in units of rank 0's M_B (the generators' limits)."""
    unit = max(st.act for st in cost.stages) * len(cost.stages) / cost.comm.num_ranks
    return replace(cost, stages=tuple(replace(st, act=st.act / unit, wact=st.wact / unit,
                                              input=st.input / unit) for st in cost.stages))


def real_step(names: list[str], hidden: int, m: int) -> None:
    """Print table 2."""
    p = 2
    model = ModelSpec("gpt", layers=8, hidden=hidden, heads=max(hidden // 64, 1), vocab=512,
                      seq=128, micro_batch=4)
    train = TrainConfig(steps=2, measure_memory=True, timeout_s=120)
    print(f"\n2. real step: GPT {model.layers} blocks, hidden {hidden}, seq 128, micro-batch 4, "
          f"p={p}, m={m}, gloo on CPU; worst-rank activation peak (MiB) and / 1F1B's")
    print(f"{'schedule':<20}{'measured':>10}{'predicted':>11}{'meas/1f1b':>11}"
          f"{'pred/1f1b':>11}{'error':>8}")
    rows = {}
    for name in names:
        params = {"v": 2} if "v" in dict(registry.library()[name].params) else {}
        schedule = registry.build(name, p, m, **params)
        cost = profile(model, schedule.placement, reps=2)
        if registry.library()[name].cost_aware:
            schedule = registry.build(name, p, m, cost=in_mb_units(cost), **params)
        predicted = max(simulate(lower(schedule), cost).metrics().peak_activation)
        ranks = launch([Job(schedule, model, train)], p, timeout_s=120)[0]
        measured = max(max(r.activations) for r in ranks)
        rows[name] = (measured, predicted)
    base_m, base_p = rows[names[0]]
    for name, (meas, pred) in rows.items():
        rm, rp = meas / base_m, pred / base_p
        print(f"{name:<20}{meas / MIB:>10.1f}{pred / MIB:>11.1f}{rm:>11.3f}{rp:>11.3f}"
              f"{100 * (rm / rp - 1):>7.1f}%", flush=True)
    print("error = measured ratio vs predicted ratio; measured = live saved tensors, outputs "
          "and W's (input, output gradient) pairs after every op; predicted = the simulator's "
          "peak with the profiled act (M_B) and wact (M_W)")


def main() -> None:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--batch", type=int, nargs="+", default=[4])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--step-hidden", type=int, default=256)
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,zb-h1,zb-v,v-half,interleaved-1f1b")
    parser.add_argument("--stages", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--skip-step", action="store_true", help="only table 1")
    add_arguments(parser)
    args = parser.parse_args()
    torch.manual_seed(0)
    per_stage(args.hidden, args.batch, args.seq, args.stages.split(","), where(args))
    if not args.skip_step:
        real_step(args.schedules.split(","), args.step_hidden, args.microbatches)


if __name__ == "__main__":
    main()
