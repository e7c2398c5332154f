"""One home for the figures FlexPipe's model presets share: the shapes of the named transformers
and the hardware they are costed on. The planner's presets (``flexpipe.plan.presets``: per-layer
profiles of whole GPTs) and the stage-graph presets (``flexpipe.graphs.presets``: CLIP,
encoder-decoder, sharded vocabulary) both build their ``TransformerSpec`` here, so a model's
shape or the assumed device is written once. (The runnable torch models of
``flexpipe.runtime.models.zoo`` are small CPU-sized modules, not costed presets.)
"""

from __future__ import annotations

from typing import NamedTuple

from flexpipe.cost.transformer import TransformerSpec
from flexpipe.errors import ConfigError

A100_FLOPS = 312e12  # dense fp16 peak FLOP/s of one A100
EFFICIENCY = 0.5  # fraction of the peak the presets assume
GPT2_VOCAB = 50257


class Shape(NamedTuple):
    """A transformer's layers, hidden size, attention heads and sequence length."""

    layers: int
    hidden: int
    heads: int
    seq: int


TRANSFORMERS: dict[str, Shape] = {
    "gpt-1.3b": Shape(24, 2048, 16, 2048),
    "gpt-6.7b": Shape(32, 4096, 32, 2048),
    "gpt-13b": Shape(40, 5120, 40, 2048),
    "gpt-64l": Shape(62, 4096, 32, 2048),
    "vit-h14": Shape(32, 1280, 16, 257),  # CLIP's image tower (ViT-H/14, 256 patches + class)
    "clip-text": Shape(24, 1024, 16, 77),  # CLIP's text tower
    "t5-large-encoder": Shape(24, 1024, 16, 512),
    "t5-large-decoder": Shape(24, 1024, 16, 128),
}


def transformer(name: str, *, micro_batch: int = 1, vocab: int | None = None) -> TransformerSpec:
    """The ``TransformerSpec`` of preset ``name`` on the presets' device (an A100 at 50%)."""
    if name not in TRANSFORMERS:
        raise ConfigError(f"unknown transformer preset {name!r} "
                          f"(known: {', '.join(TRANSFORMERS)})")
    shape = TRANSFORMERS[name]
    return TransformerSpec(layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                           seq=shape.seq, micro_batch=micro_batch, vocab=vocab,
                           device_flops=A100_FLOPS, efficiency=EFFICIENCY)
