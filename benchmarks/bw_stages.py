"""The stages the B/W split benchmarks measure (``bw_memory.py``, ``bw_split.py``) and where
they run: the CPU in float32 by default, or a GPU (``--device cuda``, e.g. ``--dtype bfloat16``
for a GPT-1.3B-sized layer: ``--hidden 2048 --seq 2048 --heads 16 --layers 1``).

Stages (each ``--layers`` layers deep):
- ``gpt``: the built-in GPT's blocks (SDPA attention: a fused kernel where the device has one);
- ``gpt-math``: the same blocks with the math attention kernel, which saves the attention
  probabilities for backward (the zero-bubble paper's 5as term);
- ``encoder``: ``nn.TransformerEncoderLayer``s (pre-norm, GELU, 4h, no dropout).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from flexpipe.runtime.models.gpt import Block, GPTConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("gpt", "gpt-math", "encoder")


@dataclass(frozen=True)
class Where:
    """Device, precision and shape of the measured stages."""

    device: str = "cpu"
    dtype: str = "float32"
    layers: int = 2
    """Layers per stage."""
    heads: int = 0
    """Attention heads (0: one per 64 of the width)."""

    @property
    def cuda(self) -> bool:
        """Whether the stages run on a GPU."""
        return self.device.startswith("cuda")

    def heads_at(self, h: int) -> int:
        """The heads at width ``h``."""
        return self.heads or max(h // 64, 1)

    def describe(self) -> str:
        """One line for the table's header."""
        return f"{self.device}, {self.dtype}, {self.layers} layers per stage"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every B/W benchmark shares."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--layers", type=int, default=2, help="layers per stage")
    parser.add_argument("--heads", type=int, default=0, help="attention heads (0: hidden/64)")


def where(args: argparse.Namespace) -> Where:
    """The ``Where`` the parsed options name (a clear error when CUDA is asked for but absent)."""
    at = Where(args.device, args.dtype, args.layers, args.heads)
    if at.cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    if args.layers < 1:
        raise SystemExit(f"--layers {args.layers}: a stage needs at least one layer")
    return at


def stage(kind: str, h: int, seq: int, at: Where) -> nn.Module:
    """A stage of ``at.layers`` layers of ``kind`` at width ``h``, on ``at``'s device and dtype."""
    heads = at.heads_at(h)
    if kind == "encoder":
        layers: list[nn.Module] = [nn.TransformerEncoderLayer(
            h, heads, 4 * h, dropout=0.0, activation="gelu", batch_first=True, norm_first=True)
            for _ in range(at.layers)]
    else:
        cfg = GPTConfig(vocab=256, hidden=h, heads=heads, layers=at.layers, seq=seq)
        layers = [Block(cfg) for _ in range(at.layers)]
    return nn.Sequential(*layers).to(device=at.device, dtype=DTYPES[at.dtype])


def label(kind: str, at: Where) -> str:
    """The stage's row label."""
    return f"{kind} x{at.layers}"


def attention_kernel(kind: str) -> contextlib.AbstractContextManager[None]:
    """The math attention kernel for ``gpt-math``, the default kernel otherwise."""
    if kind == "gpt-math":
        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def sample(batch: int, seq: int, h: int, at: Where) -> torch.Tensor:
    """A random stage input (batch, seq, h)."""
    return torch.randn(batch, seq, h, device=at.device, dtype=DTYPES[at.dtype])


class Marks:
    """Timestamps between the timed parts of one round. On the CPU: the process's CPU time
    (``cpu``) or wall time (``wall``). On a GPU: CUDA events on the current stream, so the
    times are the GPU's; the round starts with the GPU idle (synchronised) and its parts run
    back to back, as in a real step, with no synchronisation between them."""

    def __init__(self, at: Where, clock: str = "cpu") -> None:
        self.cuda = at.cuda
        self.clock: Callable[[], float] = {"cpu": time.process_time,
                                           "wall": time.perf_counter}[clock]
        self.stamps: list[Any] = []
        if self.cuda:
            torch.cuda.synchronize()

    def mark(self) -> None:
        """A timestamp now (on a GPU: when the GPU gets here)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.stamps.append(event)
        else:
            self.stamps.append(self.clock())

    def spans(self) -> list[float]:
        """Milliseconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairwise(self.stamps)]
        return [1e3 * (b - a) for a, b in pairwise(self.stamps)]
