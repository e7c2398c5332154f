"""B/W split overhead: (T_B + T_W) / T_BW per stage, at several widths.

T_BW is one fused backward; T_B and T_W are the split the executor runs
(``flexpipe.runtime.execution.wgrad``): B computes the input gradients (freeing the graph but for
the weight layers' inputs and output gradients), W one product per weight. The stage is two of the
built-in GPT's blocks, or two ``nn.TransformerEncoderLayer``s. Rounds alternate fused and split
on fresh forwards; the table gives medians of the rounds. Times are the process's CPU time
(``--clock cpu``, the default, with one thread: what the work costs, not how long it waited for
a core on a shared machine) or wall time (``--clock wall``). Both backwards of a round start
from the same gradient state (``--grads first``: none, a step's first micro-batch;
``--grads accumulate``: present, the step's other micro-batches). Target: <= 1.05 at every width.

    .venv/bin/python benchmarks/bw_split.py [--hidden 128 256 512 1024] [--repeat 15]
        [--grads first|accumulate]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from flexpipe.runtime.execution.wgrad import WeightWork, prepare, recording
from flexpipe.runtime.models.gpt import Block, GPTConfig


def gpt_stage(h: int, seq: int) -> nn.Module:
    """Two built-in GPT blocks (heads of 64)."""
    cfg = GPTConfig(vocab=256, hidden=h, heads=max(h // 64, 1), layers=2, seq=seq)
    return nn.Sequential(Block(cfg), Block(cfg))


def encoder_stage(h: int, seq: int) -> nn.Module:
    """Two ``nn.TransformerEncoderLayer``s (pre-norm, GELU, 4h, no dropout)."""
    return nn.Sequential(*(nn.TransformerEncoderLayer(
        h, max(h // 64, 1), 4 * h, dropout=0.0, activation="gelu", batch_first=True,
        norm_first=True) for _ in range(2)))


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = CLOCKS["cpu"]


def _timed(fn: Callable[[], object]) -> float:
    t0 = _clock()
    fn()
    return 1e3 * (_clock() - t0)


def measure(stage: nn.Module, x: torch.Tensor, repeat: int, accumulate: bool
            ) -> tuple[list[float], list[float], list[float]]:
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
        t_bw = _timed(lambda: torch.autograd.backward(
            [out], [g], inputs=[xi, *params]))  # noqa: B023
        work = WeightWork()
        xi = x.detach().requires_grad_()
        with recording(work):
            out = stage(xi)
        reset()

        def run_b() -> None:
            with work.backward_input():  # noqa: B023
                torch.autograd.backward([out], [g], inputs=[xi, *params])  # noqa: B023

        t_b = _timed(run_b)
        t_w = _timed(work.run)
        if i >= 3:  # warm-up
            bw.append(t_bw)
            b.append(t_b)
            w.append(t_w)
    return bw, b, w


STAGES = {"gpt 2 blocks": gpt_stage, "encoder 2 layers": encoder_stage}


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--grads", choices=("first", "accumulate"), default="first",
                        help="gradient state before each backward: none (a step's first "
                             "micro-batch) or present (the others add into it)")
    args = parser.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"batch {args.batch} x seq {args.seq}, {args.threads} threads, {args.clock} time, "
          f"median of {args.repeat} rounds (fused and split alternate), gradients: "
          f"{args.grads}")
    print(f"{'stage':<18}{'hidden':>7}{'T_BW ms':>10}{'T_B ms':>10}{'T_W ms':>10}"
          f"{'(B+W)/BW':>10}{'of minima':>11}")
    for h in args.hidden:
        x = torch.randn(args.batch, args.seq, h)
        for name, make in STAGES.items():
            bw, b, w = measure(make(h, args.seq), x, args.repeat, args.grads == "accumulate")
            t_bw, t_b, t_w = (statistics.median(v) for v in (bw, b, w))
            lowest = (min(b) + min(w)) / min(bw)
            print(f"{name:<18}{h:>7}{t_bw:>10.2f}{t_b:>10.2f}{t_w:>10.2f}"
                  f"{(t_b + t_w) / t_bw:>10.3f}{lowest:>11.3f}", flush=True)
    print("(B+W)/BW: of the medians over the rounds; of minima: of each time's fastest round "
          "(the least disturbed on a shared machine)")


if __name__ == "__main__":
    main()
