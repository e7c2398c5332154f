"""Balanced layer partition for a schedule's placement (``flexpipe run --partition auto``).

A rank runs all its stages one pass at a time, so what must be even is each RANK's work, not
each stage's: under a V placement rank 0 holds the first and the last stage, and an even split
of the layers gives it the cheap embedding and the head while another rank gets the heavy
blocks. Layer cost is counted, not timed, so the partition is the same on every run: the
floating-point operations of one micro-batch through the layer (``torch.utils.flop_counter``),
forward and backward. The partition minimises the busiest rank's work, then the busiest stage's,
then the spread: ``flexpipe.cost.partition.balanced_partition``, the one pure balancer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from flexpipe.cost.partition import balanced_partition
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.stage import as_tuple, even_partition
from flexpipe.runtime.models.kinds import build_model, kind, make_batch, model_segments
from flexpipe.runtime.models.spec import ModelSpec


def layer_flops(layers: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> list[float]:
    """Forward + backward floating-point operations of each layer on ``inputs`` (one
    micro-batch), passed through the layers in turn."""
    out: list[float] = []
    x = tuple(inputs)
    for layer in layers:
        leaves = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x)
        with FlopCounterMode(display=False) as counter:
            y = as_tuple(layer(*leaves))
            floats = [t for t in y if t.requires_grad]
            if floats:
                torch.autograd.backward(floats, [torch.ones_like(t) for t in floats])
        out.append(float(counter.get_total_flops()))
        x = tuple(t.detach() for t in y)
    return out


def layer_params(layers: Sequence[nn.Module]) -> list[float]:
    """Trainable parameters of each layer (DeepSpeed's ``partition_method="parameters"``)."""
    return [float(sum(p.numel() for p in layer.parameters() if p.requires_grad))
            for layer in layers]


def auto_partition(spec: ModelSpec, stage_rank: Sequence[int],
                   by: str = "flops") -> tuple[int, ...]:
    """The balanced partition of chain model ``spec`` (built-in, or your own chain of layers)
    for a placement (``stage_rank``), by counted FLOPs or by parameters."""
    if kind(spec).layers is not None:
        layers = build_model(spec)[0]
    else:
        segments = model_segments(spec)[0] if kind(spec).own else []
        if len(segments) != 1:
            raise ConfigError(f"--partition auto/params balances chain models (gpt, mlp, a "
                              f"chain of your own layers), not {spec.name!r} (a graph or a "
                              "model cut at split points); give layers per stage instead")
        layers = list(segments[0].layers)
    inputs = make_batch(spec, 0, 1)[0][0]
    return tuple(split_layers(layers, by, stage_rank, inputs))


def split_layers(layers: Sequence[nn.Module], by: str | Sequence[int],
                 stage_rank: Sequence[int], inputs: Sequence[torch.Tensor] | None = None
                 ) -> list[int]:
    """Layers per stage: ``layers`` (as even as possible), ``flops`` (the ranks' counted
    forward + backward FLOPs on ``inputs``, one micro-batch), ``params`` (the ranks'
    parameters), or the counts themselves (checked)."""
    stages = len(stage_rank)
    if not isinstance(by, str):
        counts = [int(c) for c in by]
        if len(counts) != stages or min(counts, default=0) < 1 or sum(counts) != len(layers):
            raise ConfigError(f"partition {counts} must give each of the {stages} stages at "
                              f"least one layer and cover all {len(layers)} layers")
        return counts
    if by == "layers":
        return even_partition(len(layers), stages)
    if by == "params":
        return balanced_partition(layer_params(layers), stage_rank)
    if by == "flops":
        if inputs is None:
            raise ConfigError("partition 'flops' counts each layer's work on an example "
                              "micro-batch: give example inputs")
        return balanced_partition(layer_flops(layers, inputs), stage_rank)
    raise ConfigError(f"unknown partition {by!r} (layers, flops, params, or layers per stage)")
