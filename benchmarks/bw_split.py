"""B/W split overhead: (T_B + T_W) / T_BW for an MLP block and a transformer block.

T_BW is one fused backward (``torch.autograd.backward`` towards inputs and parameters); T_B and
T_W are FlexPipe's split (``flexpipe.runtime.split``): B computes only the input gradient and
keeps the graph, W only the weight gradients left. The target is a ratio <= 1.15.

    .venv/bin/python benchmarks/bw_split.py [--repeat 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from flexpipe.runtime.gpt import Block, GPTConfig
from flexpipe.runtime.split import backward_input, backward_weight


def mlp_block(h: int) -> nn.Module:
    """Linear - GELU - Linear with a residual and a LayerNorm (a transformer's MLP half)."""

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(h)
            self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    return MLP()


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(block: nn.Module, x: torch.Tensor, repeat: int) -> tuple[float, float, float]:
    """Median T_BW, T_B, T_W in milliseconds."""
    params = [p for p in block.parameters() if p.requires_grad]
    bw, b, w = [], [], []
    for i in range(repeat + 3):
        xi = x.detach().requires_grad_()
        out = block(xi)
        g = torch.ones_like(out)
        t_bw = _timed(lambda: torch.autograd.backward(
            [out], [g], inputs=[xi, *params]))  # noqa: B023
        xi = x.detach().requires_grad_()
        out = block(xi)
        holder: dict[str, object] = {}

        def run_b() -> None:
            holder["w"] = backward_input([out], [g], [xi], params)[1]  # noqa: B023

        t_b = _timed(run_b)
        t_w = _timed(lambda: backward_weight(holder["w"]))  # type: ignore[arg-type]  # noqa: B023
        if i >= 3:  # warm-up
            bw.append(t_bw)
            b.append(t_b)
            w.append(t_w)
    return (1e3 * statistics.median(bw), 1e3 * statistics.median(b),
            1e3 * statistics.median(w))


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024, help="batch x sequence")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    h, seq = args.hidden, 128
    cfg = GPTConfig(vocab=256, hidden=h, heads=8, layers=1, seq=seq)
    cases = {
        "MLP block": (mlp_block(h), torch.randn(args.tokens // seq, seq, h)),
        "transformer block": (Block(cfg), torch.randn(args.tokens // seq, seq, h)),
    }
    print(f"hidden {h}, {args.tokens} tokens, {args.threads} threads, median of {args.repeat}")
    print(f"{'block':<20}{'T_BW ms':>10}{'T_B ms':>10}{'T_W ms':>10}{'(B+W)/BW':>11}")
    for name, (block, x) in cases.items():
        t_bw, t_b, t_w = measure(block, x, args.repeat)
        print(f"{name:<20}{t_bw:>10.2f}{t_b:>10.2f}{t_w:>10.2f}{(t_b + t_w) / t_bw:>11.3f}")


if __name__ == "__main__":
    main()
