"""B/W split overhead: (T_B + T_W) / T_BW per stage, at several widths.

T_BW is one fused backward; T_B and T_W are the split the executor runs
(``flexpipe.runtime.split``): B computes the input gradients (freeing the graph but for what W
reads), W the weight gradients. ``--path fast`` (the default) is what runs: linear layers by
the fast path (``split.linear``: one product per weight), every other product by the rule;
``--path rule`` sends the linear layers through the rule too (what the fast path saves). The
stages are those of ``bw_stages.py`` (by default two built-in GPT blocks, or two
``nn.TransformerEncoderLayer``s).
Rounds alternate fused and split on fresh forwards; the table gives medians of the rounds and
the median of the rounds' own ratios (``paired``: a round's two backwards run back to back). Times
on the CPU are the process's CPU time (``--clock cpu``, the default, with one thread: what the
work costs, not how long it waited for a core on a shared machine) or wall time
(``--clock wall``); on a GPU (``--device cuda``) CUDA events, each round from an idle GPU. Both
backwards of a round start from the same gradient state (``--grads first``: none, a step's
first micro-batch; ``--grads accumulate``: present, the step's other micro-batches). Target:
<= 1.05 at every width. The host allocator is set as in FlexPipe's rank processes
(``--allocator keep``: glibc keeps freed memory; ``system``: its defaults).

    .venv/bin/python benchmarks/bw_split.py [--hidden 128 256 512 1024] [--repeat 15]
        [--grads first|accumulate] [--path fast|rule]
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
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from flexpipe.runtime.processes.allocator import keep_freed_memory
from flexpipe.runtime.split import WeightWork, linear, recording


class Rounds:
    """Fused and split backwards of ``stage`` on fresh forwards of ``x``, each from the same
    gradient state: none (the step's first micro-batch) or, with ``accumulate``, gradients
    already there (the other micro-batches: every weight gradient is added)."""

    def __init__(self, stage: nn.Module, x: torch.Tensor, accumulate: bool) -> None:
        self.stage, self.x, self.accumulate = stage, x, accumulate
        self.params = [p for p in stage.parameters() if p.requires_grad]

    def _reset(self) -> None:
        self.stage.zero_grad(set_to_none=not self.accumulate)
        if self.accumulate:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

    def fused(self, marks: Marks) -> None:
        """F (untimed), then BW between two marks."""
        xi = self.x.detach().requires_grad_()
        out = self.stage(xi)
        self._reset()
        marks.mark()
        torch.autograd.backward([out], [torch.ones_like(out)], inputs=[xi, *self.params])
        marks.mark()

    def split(self, marks: Marks) -> None:
        """F (untimed, recording for the split), then B and W between three marks."""
        work, xi = WeightWork(), self.x.detach().requires_grad_()
        with recording(work):
            out = self.stage(xi)
        self._reset()
        marks.mark()
        with work.backward_input():
            torch.autograd.backward([out], [torch.ones_like(out)], inputs=[xi, *self.params])
        marks.mark()
        work.run()
        marks.mark()


def measure(rounds: Rounds, repeat: int, at: Where, clock: str
            ) -> tuple[list[float], list[float], list[float]]:
    """T_BW, T_B, T_W of every round in milliseconds (fused and split alternate)."""
    bw, b, w = [], [], []
    for i in range(repeat + 3):
        fused, split = Marks(at, clock), Marks(at, clock)
        rounds.fused(fused)
        rounds.split(split)
        (t_bw,), (t_b, t_w) = fused.spans(), split.spans()
        if i >= 3:  # warm-up
            bw.append(t_bw)
            b.append(t_b)
            w.append(t_w)
    return bw, b, w


class KernelMarks(Marks):
    """On a GPU: the kernel time (ms, torch.profiler) from the first mark to the last."""

    def __init__(self, at: Where) -> None:
        super().__init__(at)
        self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def mark(self) -> None:
        """The first mark starts the profiler; later ones only note the time."""
        if not self.stamps:
            self.profiler.start()
        self.stamps.append(None)

    def spans(self) -> list[float]:
        """One span: the kernels' time between the first and the last mark."""
        torch.cuda.synchronize()
        self.profiler.stop()
        kernels = [e for e in self.profiler.events() if e.device_type == DeviceType.CUDA]
        return [sum(e.device_time_total for e in kernels) / 1e3]


def kernel_ms(rounds: Rounds, at: Where) -> tuple[float, float]:
    """GPU kernel time (ms) of one fused backward and of one split (B and W)."""
    fused = KernelMarks(at)
    rounds.fused(fused)
    bw = fused.spans()[0]  # one profiler at a time
    split = KernelMarks(at)
    rounds.split(split)
    return bw, split.spans()[0]


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
    parser.add_argument("--allocator", choices=("keep", "system"), default="keep",
                        help="keep: glibc keeps freed memory, as in FlexPipe's rank processes "
                             "(flexpipe.runtime.processes.allocator); system: glibc's defaults")
    parser.add_argument("--path", choices=("fast", "rule"), default="fast",
                        help="fast: linear layers by the fast path (what runs); rule: every "
                             "product by the rule")
    add_arguments(parser)
    args = parser.parse_args()
    linear.ENABLED[0] = args.path == "fast"
    if args.allocator == "keep":
        keep_freed_memory()
    at = where(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cuda = at.cuda
    timer = "GPU time (CUDA events)" if cuda else f"{args.clock} time"
    print(f"seq {args.seq}, {at.describe()}, {args.threads} CPU threads, {timer}, median of "
          f"{args.repeat} rounds (fused and split alternate), gradients: {args.grads}, "
          f"allocator: {args.allocator}, path: {args.path}")
    print(f"{'stage':<14}{'hidden':>7}{'batch':>6}{'T_BW ms':>10}{'T_B ms':>10}{'T_W ms':>10}"
          f"{'(B+W)/BW':>10}{'paired':>8}{'of minima':>11}"
          + (f"{'BW kernels':>12}{'B+W kernels':>12}" if cuda else ""))
    for h in args.hidden:
        for batch in args.batch:
            x = sample(batch, args.seq, h, at)
            for kind in args.stages.split(","):
                rounds = Rounds(bw_stage(kind, h, args.seq, at), x, args.grads == "accumulate")
                with attention_kernel(kind):
                    bw, b, w = measure(rounds, args.repeat, at, args.clock)
                    kernels = kernel_ms(rounds, at) if cuda else None
                t_bw, t_b, t_w = (statistics.median(v) for v in (bw, b, w))
                lowest = (min(b) + min(w)) / min(bw)
                paired = statistics.median((i + j) / k for i, j, k in zip(b, w, bw, strict=True))
                print(f"{label(kind, at):<14}{h:>7}{batch:>6}{t_bw:>10.2f}{t_b:>10.2f}"
                      f"{t_w:>10.2f}{(t_b + t_w) / t_bw:>10.3f}{paired:>8.3f}{lowest:>11.3f}"
                      + (f"{kernels[0]:>12.2f}{kernels[1]:>12.2f}" if kernels else ""),
                      flush=True)
    print("(B+W)/BW: of the medians over the rounds; paired: the median of each round's own "
          "ratio (its fused and split backwards run back to back, so a slower spell of a shared "
          "machine slows both); of minima: of each time's fastest round"
          + ("; kernels: ms the GPU spent in kernels in one more round (torch.profiler)"
             if cuda else ""))


if __name__ == "__main__":
    main()
