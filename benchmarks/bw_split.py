"""B/W split overhead: (T_B + T_W) / T_BW per stage, at several widths.

T_BW is one fused backward; T_B and T_W are the split the executor runs
(``flexpipe.runtime.execution.wgrad``): B computes the input gradients (freeing the graph but for
the weight layers' inputs and output gradients), W one product per weight. The stages are those
of ``bw_stages.py`` (by default two built-in GPT blocks, or two ``nn.TransformerEncoderLayer``s).
Rounds alternate fused and split on fresh forwards; the table gives medians of the rounds. Times
on the CPU are the process's CPU time (``--clock cpu``, the default, with one thread: what the
work costs, not how long it waited for a core on a shared machine) or wall time
(``--clock wall``); on a GPU (``--device cuda``) CUDA events, each round from an idle GPU. Both
backwards of a round start from the same gradient state (``--grads first``: none, a step's
first micro-batch; ``--grads accumulate``: present, the step's other micro-batches). Target:
<= 1.05 at every width.

    .venv/bin/python benchmarks/bw_split.py [--hidden 128 256 512 1024] [--repeat 15]
        [--grads first|accumulate]
    python benchmarks/bw_split.py --device cuda --dtype bfloat16 --hidden 2048 --seq 2048 \
        --heads 16 --layers 1 --batch 1 2 4   # a GPT-1.3B-sized layer on a GPU
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bw_stages import Marks, Where, add_arguments, attention_kernel, label, sample, where
from bw_stages import stage as bw_stage
from torch import nn

from flexpipe.runtime.execution.wgrad import WeightWork, prepare, recording


def measure(stage: nn.Module, x: torch.Tensor, repeat: int, accumulate: bool, at: Where,
            clock: str) -> tuple[list[float], list[float], list[float]]:
    """T_BW, T_B, T_W of every round in milliseconds. Both backwards start from the same
    gradient state: none (the step's first micro-batch) or, with ``accumulate``, gradients
    already there (the other micro-batches: every weight gradient is added)."""
    prepare(stage)
    params = [p for p in stage.parameters() if p.requires_grad]

    def reset() -> None:
        stage.zero_grad(set_to_none=not accumulate)
        if accumulate:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    bw, b, w = [], [], []
    for i in range(repeat + 3):
        xi = x.detach().requires_grad_()
        out = stage(xi)
        g = torch.ones_like(out)
        reset()
        fused = Marks(at, clock)
        fused.mark()
        torch.autograd.backward([out], [g], inputs=[xi, *params])
        fused.mark()
        work = WeightWork()
        xi = x.detach().requires_grad_()
        with recording(work):
            out = stage(xi)
        reset()
        split = Marks(at, clock)
        split.mark()
        with work.backward_input():
            torch.autograd.backward([out], [g], inputs=[xi, *params])
        split.mark()
        work.run()
        split.mark()
        (t_bw,), (t_b, t_w) = fused.spans(), split.spans()
        if i >= 3:  # warm-up
            bw.append(t_bw)
            b.append(t_b)
            w.append(t_w)
    return bw, b, w


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="on the CPU; a GPU is timed with CUDA events")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", default="gpt,encoder", help="of gpt, gpt-math, encoder")
    parser.add_argument("--grads", choices=("first", "accumulate"), default="first",
                        help="gradient state before each backward: none (a step's first "
                             "micro-batch) or present (the others add into it)")
    add_arguments(parser)
    args = parser.parse_args()
    at = where(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    timer = "GPU time (CUDA events)" if at.device.startswith("cuda") else f"{args.clock} time"
    print(f"seq {args.seq}, {at.describe()}, {args.threads} CPU threads, {timer}, median of "
          f"{args.repeat} rounds (fused and split alternate), gradients: {args.grads}")
    print(f"{'stage':<14}{'hidden':>7}{'batch':>6}{'T_BW ms':>10}{'T_B ms':>10}{'T_W ms':>10}"
          f"{'(B+W)/BW':>10}{'of minima':>11}")
    for h in args.hidden:
        for batch in args.batch:
            x = sample(batch, args.seq, h, at)
            for kind in args.stages.split(","):
                with attention_kernel(kind):
                    bw, b, w = measure(bw_stage(kind, h, args.seq, at), x, args.repeat,
                                       args.grads == "accumulate", at, args.clock)
                t_bw, t_b, t_w = (statistics.median(v) for v in (bw, b, w))
                lowest = (min(b) + min(w)) / min(bw)
                print(f"{label(kind, at):<14}{h:>7}{batch:>6}{t_bw:>10.2f}{t_b:>10.2f}"
                      f"{t_w:>10.2f}{(t_b + t_w) / t_bw:>10.3f}{lowest:>11.3f}", flush=True)
    print("(B+W)/BW: of the medians over the rounds; of minima: of each time's fastest round "
          "(the least disturbed on a shared machine)")


if __name__ == "__main__":
    main()
