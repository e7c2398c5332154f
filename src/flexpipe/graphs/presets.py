"""Model presets that are not chains, from the transformer formulas of
``flexpipe.cost.transformer`` (times in ms on a 312 TFLOP/s device at 50% efficiency, memory in
bytes, 100 GB/s links with 10 us latency):

- ``clip``: a ViT-H/14-like image tower (32 layers, h 1280, 257 tokens) and a text tower
  (24 layers, h 1024, 77 tokens) meeting in a contrastive-loss stage.
- ``encdec``: a T5-large-like encoder (24 layers, 512 tokens) whose output feeds every decoder
  stage (24 layers, 128 tokens, with cross-attention).
- ``gpt-sharded-vocab``: a 32-layer GPT (h 4096, 2048 tokens) with a 256k vocabulary whose
  embedding and head are each one gang of p shard stages, one per device.

- ``tessel-v``, ``tessel-m``, ``tessel-x``, ``tessel-nn``: Tessel's placement cases in unit
  blocks (``flexpipe.graphs.tessel``).

Each preset lists layouts (how stages are cut and placed); ``preset(name, p, layout)`` builds one
``GraphModel``, ``preset_layouts(name, p)`` every layout that fits p devices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from flexpipe.cost.model import Comm, CostModel, StageCost, merge_stages
from flexpipe.cost.presets import A100_FLOPS, EFFICIENCY, TRANSFORMERS, transformer
from flexpipe.cost.transformer import BYTES, TransformerSpec, stage_cost
from flexpipe.errors import ConfigError
from flexpipe.graphs import tessel
from flexpipe.graphs.model import GraphModel, balanced_cut, work
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule

MS_PER_FLOP = 1e3 / (A100_FLOPS * EFFICIENCY)
PROJ = 1024  # CLIP's joint embedding width
LATENCY_MS, BYTES_PER_MS = 0.01, 100e9 / 1e3
Layers = tuple[StageCost, ...]


def _spec(name: str, batch: int) -> TransformerSpec:
    return transformer(name, micro_batch=batch)


def _layers(spec: TransformerSpec) -> Layers:
    """One ``StageCost`` per transformer layer of ``spec``."""
    return (stage_cost(spec, 1, False, False),) * spec.layers


def _stage(f: float, b: float, w: float, *, act: float, wact: float, params: float,
           out_bytes: float) -> StageCost:
    """A stage from FLOPs (converted to ms) and bytes."""
    return StageCost({"F": f * MS_PER_FLOP, "B": b * MS_PER_FLOP, "W": w * MS_PER_FLOP},
                     act=act, wact=wact, input=out_bytes, params=params, out_bytes=out_bytes)


def _comm(p: int) -> Comm:
    return Comm.uniform(p, LATENCY_MS, BYTES_PER_MS)


def _chain(first: int, n: int) -> list[tuple[int, int]]:
    return [(first + i, first + i + 1) for i in range(n - 1)]


def _devices(p: int, a: Layers, b: Layers) -> int:
    """Devices for branch ``a`` when a and b sit side by side, in proportion to their work."""
    wa, wb = sum(map(work, a)), sum(map(work, b))
    return min(p - 1, max(1, round(p * wa / (wa + wb))))


# --- clip -------------------------------------------------------------------------------------

def _clip_parts() -> tuple[Layers, Layers, StageCost]:
    batch = 8
    image = _layers(_spec("vit-h14", batch))
    text = _layers(_spec("clip-text", batch))
    widths = TRANSFORMERS["vit-h14"].hidden + TRANSFORMERS["clip-text"].hidden
    proj = 2 * batch * widths * PROJ  # both projections, then b x b logits
    loss = _stage(proj, proj, proj, act=4 * batch * 2 * PROJ, wact=4 * batch * 2 * PROJ,
                  params=BYTES * widths * PROJ, out_bytes=4 * batch)
    return image, text, loss


def _two_towers(name: str, layout: str, p: int, towers: Sequence[tuple[Layers, Sequence[int]]],
                join: StageCost, join_rank: int, chain: Layers) -> GraphModel:
    """Each tower cut into one stage per listed rank (in order), every tower's last stage
    feeding one ``join`` stage on ``join_rank``."""
    stages: list[StageCost] = []
    ranks: list[int] = []
    edges: list[tuple[int, int]] = []
    lasts = []
    for layers, on in towers:
        edges += _chain(len(stages), len(on))
        stages += balanced_cut(layers, len(on))
        ranks += on
        lasts.append(len(stages) - 1)
    edges += [(s, len(stages)) for s in lasts]
    graph = StageGraph(len(stages) + 1, tuple(edges))
    cost = CostModel((*stages, join), _comm(p))
    return GraphModel(name, layout, graph, Placement((*ranks, join_rank), p), cost, chain)


def clip(p: int, layout: str) -> GraphModel:
    """The two-tower CLIP-like model on p devices (layouts: side-by-side, shared, crossed)."""
    image, text, loss = _clip_parts()
    k = _devices(p, image, text)
    down, up = list(range(p)), list(range(p - 1, -1, -1))
    towers = {"side-by-side": ([(image, down[:k]), (text, down[k:])], p - 1),
              "shared": ([(image, down), (text, down)], p - 1),
              "crossed": ([(image, down), (text, up)], p - 1)}
    spec, join_rank = towers[layout]
    return _two_towers("clip", layout, p, spec, loss, join_rank, (*image, *text, loss))


# --- encoder-decoder --------------------------------------------------------------------------

def _encdec_parts() -> tuple[Layers, Layers]:
    batch, enc, dec = 4, TRANSFORMERS["t5-large-encoder"], TRANSFORMERS["t5-large-decoder"]
    h, s_enc, s_dec = enc.hidden, enc.seq, dec.seq
    encoder = _layers(_spec("t5-large-encoder", batch))
    self_attn = stage_cost(_spec("t5-large-decoder", batch), 1, False, False)
    linear = 2 * batch * h * h * (2 * s_dec + 2 * s_enc)  # q, o over the decoder; k, v over enc
    scores = 4 * batch * s_dec * s_enc * h
    extra = (linear + scores) * MS_PER_FLOP
    times = dict(self_attn.times)
    times["F"], times["B"], times["W"] = (times["F"] + extra, times["B"] + extra,
                                          times["W"] + linear * MS_PER_FLOP)
    kept = BYTES * batch * (2 * s_enc * h + s_dec * h + s_dec * s_enc)
    decoder = (replace(self_attn, times=times, act=self_attn.act + kept,
                       params=self_attn.params + 4 * h * h * BYTES),) * dec.layers
    return encoder, decoder


def encdec(p: int, layout: str) -> GraphModel:
    """Encoder feeding every decoder stage (layouts: split, shared, vshape)."""
    encoder, decoder = _encdec_parts()
    k = _devices(p, encoder, decoder)
    down, up = list(range(p)), list(range(p - 1, -1, -1))
    table = {"split": (down[:k], down[k:]), "shared": (down, down), "vshape": (down, up)}
    enc_ranks, dec_ranks = table[layout]
    ne, nd = len(enc_ranks), len(dec_ranks)
    edges = _chain(0, ne) + [(ne - 1, ne + j) for j in range(nd)] + _chain(ne, nd)
    stages = (*balanced_cut(encoder, ne), *balanced_cut(decoder, nd))
    return GraphModel("encdec", layout, StageGraph(ne + nd, tuple(edges)),
                      Placement((*enc_ranks, *dec_ranks), p), CostModel(stages, _comm(p)),
                      (*encoder, *decoder))


# --- GPT with a sharded vocabulary ------------------------------------------------------------

def _vocab_parts(p: int) -> tuple[Layers, StageCost, StageCost]:
    """The blocks, one embedding shard and one head shard (1/p of the vocabulary each)."""
    batch, gpt, vocab = 1, TRANSFORMERS["gpt-6.7b"], 256_000
    h, s = gpt.hidden, gpt.seq
    blocks = _layers(_spec("gpt-6.7b", batch))
    boundary = BYTES * s * batch * h
    table = BYTES * vocab * h / p
    gather = 2 * s * batch * h  # masked lookup and scatter-add of the shard: next to nothing
    embed = _stage(gather, gather, gather, act=4 * s * batch, wact=4 * s * batch, params=table,
                   out_bytes=boundary)
    logits = 2 * s * batch * h * vocab / p
    head = _stage(logits, logits, logits, act=4 * s * batch * vocab / p + boundary,
                  wact=boundary, params=table, out_bytes=boundary)
    return blocks, embed, head


# Collective passes of the vocabulary-parallel embedding (its forward all-reduces the looked-up
# rows) and head (the loss all-reduces softmax statistics in F, the input gradient is all-reduced
# in B); weight gradients and the embedding's backward are local to each shard.
COLLECTIVE = (("F",), ("F", "B", "BW"))


# Block chunks per device and the device of block stage i, per layout.
PLACE: dict[str, tuple[int, Callable[[int, int], int]]] = {
    "sharded": (1, lambda p, i: i),
    "sharded-interleaved": (2, lambda p, i: i % p),
    "sharded-vshape": (2, lambda p, i: i if i < p else 2 * p - 1 - i),
}


def gpt_sharded_vocab(p: int, layout: str) -> GraphModel:
    """Embedding gang -> blocks -> head gang (layouts: sharded, sharded-interleaved,
    sharded-vshape)."""
    if p < 2:
        raise ConfigError("gpt-sharded-vocab shards its embedding and head over p >= 2 devices")
    blocks, embed, head = _vocab_parts(p)
    v, block_rank = PLACE[layout]
    nb = p * v
    first, last = p, p + nb - 1
    edges = [(e, first) for e in range(p)] + _chain(first, nb) + [(last, last + 1 + j)
                                                                   for j in range(p)]
    gangs = (tuple(range(p)), tuple(range(last + 1, last + 1 + p)))
    ranks = (*range(p), *(block_rank(p, i) for i in range(nb)), *range(p))
    stages = (embed,) * p + balanced_cut(blocks, nb) + (head,) * p
    whole_embed, whole_head = merge_stages((embed,) * p), merge_stages((head,) * p)
    graph = StageGraph(len(stages), tuple(edges), gangs, COLLECTIVE)
    return GraphModel("gpt-sharded-vocab", layout, graph,
                      Placement(ranks, p), CostModel(stages, _comm(p)),
                      (whole_embed, *blocks, whole_head))


# --- registry ---------------------------------------------------------------------------------

Builder = Callable[[int, str], GraphModel]
PRESETS: dict[str, tuple[Builder, tuple[str, ...]]] = {
    "clip": (clip, ("side-by-side", "shared", "crossed")),
    "encdec": (encdec, ("split", "shared", "vshape")),
    "gpt-sharded-vocab": (gpt_sharded_vocab, tuple(PLACE)),
    **{name: (tessel.builder(name), (tessel.LAYOUT,)) for name in tessel.PERIOD},
}


def preset(name: str, p: int, layout: str | None = None) -> GraphModel:
    """Preset ``name`` on p devices in ``layout`` (default: its first layout)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    if isinstance(p, bool) or not isinstance(p, int) or p < 2:
        raise ConfigError(f"a graph preset needs p >= 2 devices, got {p!r}")
    builder, layouts = PRESETS[name]
    layout = layout or layouts[0]
    if layout not in layouts:
        raise ConfigError(f"preset {name!r} has no layout {layout!r} (known: "
                          f"{', '.join(layouts)})")
    return builder(p, layout)


def preset_layouts(name: str, p: int) -> list[GraphModel]:
    """Every layout of preset ``name`` that can be built for p devices."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return [preset(name, p, layout) for layout in PRESETS[name][1]]


def preset_cost(name: str, schedule: Schedule, layout: str | None = None) -> CostModel:
    """The cost model of preset ``name`` for ``schedule``: of ``layout``, or of the layout whose
    stage graph and placement are the schedule's."""
    if layout is not None:
        return preset(name, schedule.num_ranks, layout).cost
    for gm in preset_layouts(name, schedule.num_ranks):
        if gm.graph == schedule.graph and gm.placement == schedule.placement:
            return gm.cost
    raise ConfigError(f"no layout of preset {name!r} on {schedule.num_ranks} devices has this "
                      f"schedule's stage graph and placement (layouts: "
                      f"{', '.join(PRESETS[name][1])})")
