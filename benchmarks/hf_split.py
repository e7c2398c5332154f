"""The B/W split's cost on a Hugging Face model's own blocks, per micro-batch size:
(T_B + T_W) / T_BW of the exported middle blocks (the model cut at its second and its last
block, so the stage holds neither the embedding nor the head), fused and split backwards
alternating on fresh forwards (``bw_split.Rounds``). On a GPU the times are CUDA events and the
kernel time of one more round (torch.profiler); on the CPU the process's CPU time.
``hf_models.py`` prints this table after each model (``--split-batches``).
"""

from __future__ import annotations

import statistics

import torch
from bw_split import Rounds, kernel_ms, measure
from bw_stages import Where
from hf_common import PREFIX, causal_lm, size, token_batch
from torch import nn

from flexpipe.runtime.user.tracing import split_points


class Blocks(nn.Module):
    """One exported segment as ``x -> y``: its largest floating input is ``x``, the other
    inputs (masks, positions) stay fixed, and ``y`` is its largest floating output."""

    def __init__(self, segment: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.segment, self.inputs = segment, inputs
        floats = [i for i, t in enumerate(inputs) if t.is_floating_point()]
        self.at = max(floats, key=lambda i: inputs[i].numel())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The segment with ``x`` in its place."""
        args = list(self.inputs)
        args[self.at] = x
        outs = [o for o in self.segment(*args) if o.is_floating_point() and o.requires_grad]
        return max(outs, key=lambda o: o.numel())


def middle(name: str, batch: int, device: str) -> Blocks:
    """The model's middle blocks as a ``Blocks`` stage at micro-batch ``batch`` on ``device``."""
    layers = size().layers
    if layers < 3:
        raise SystemExit(f"the split table needs at least 3 layers (--layers {layers})")
    ids, _ = token_batch(0, batch)
    cut = split_points(causal_lm(name), (f"{PREFIX[name]}1", f"{PREFIX[name]}{layers - 1}"),
                       (ids,))
    first, mid = (s.layers[0].to(device) for s in cut.segments[:2])
    with torch.no_grad():
        outs = first(ids.to(device))
    return Blocks(mid, tuple(o.detach() for o in outs))


def split_table(name: str, batches: list[int], device: str, repeat: int = 20) -> None:
    """Print (T_B + T_W) / T_BW of ``name``'s middle blocks at each micro-batch size."""
    at = Where(device, size().dtype, size().layers - 2)
    cuda = at.cuda
    print(f"  split cost of {at.layers} middle blocks, median of {repeat} rounds "
          f"({'CUDA events' if cuda else 'CPU time'}):")
    print(f"  {'batch':>7}{'T_BW ms':>10}{'T_B ms':>10}{'T_W ms':>10}{'(B+W)/BW':>10}"
          f"{'of minima':>11}" + (f"{'BW kernels':>12}{'B+W kernels':>12}" if cuda else ""))
    for batch in batches:
        stage = middle(name, batch, device)
        rounds = Rounds(stage, stage.inputs[stage.at], accumulate=False)
        bw, b, w = measure(rounds, repeat, at, "cpu")
        kernels = kernel_ms(rounds, at) if cuda else None
        t_bw, t_b, t_w = (statistics.median(v) for v in (bw, b, w))
        print(f"  {batch:>7}{t_bw:>10.2f}{t_b:>10.2f}{t_w:>10.2f}{(t_b + t_w) / t_bw:>10.3f}"
              f"{(min(b) + min(w)) / min(bw):>11.3f}"
              + (f"{kernels[0]:>12.2f}{kernels[1]:>12.2f}" if kernels else ""), flush=True)
