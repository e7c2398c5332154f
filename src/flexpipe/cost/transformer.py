"""An analytic cost model of a GPT-style transformer (docs/facts.md), for planning before profiling.

Per transformer layer, with s = sequence length, b = micro-batch size, h = hidden size and
a = attention heads (Narayanan et al. 2021; Korthikanti et al. 2022; Qi et al. 2024):

- forward FLOPs ``s b h (24 h + 4 s)``; input-gradient backward ``s b h (24 h + 8 s)``;
  weight-gradient backward ``24 s b h^2`` (so B + W = 2 F up to the attention terms);
- activation memory after F, ``M_B = s b (34 h + 5 a s)`` bytes (fp16), and what B leaves for W,
  ``M_W = 32 s b h`` bytes;
- parameters ``12 h^2`` per layer at 2 bytes each (fp16).

A stage's costs are the sum over its layers. Every stage sends ``2 s b h`` bytes (its fp16
output, or the input gradient back) and keeps its ``2 s b h``-byte input for recompute.

With ``vocab`` = V: the first stage also holds the input embedding (``V h`` parameters; the
lookup is a gather, counted as no FLOPs) and the last stage the output head (``V h``
parameters, untied) with one ``s b h x h V`` matrix product per pass: ``2 s b h V`` FLOPs each
for F, B and W, and the fp32 logits kept for the loss, ``4 s b V`` bytes of activation.

Times are milliseconds: FLOPs / (``device_flops`` x ``efficiency``) x 1000. Links: each
transfer takes ``latency_ms`` plus bytes / (``bandwidth_gbs`` x 1e9) seconds.

With ``tp`` > 1 the costs are one tensor-parallel rank's (``flexpipe.cost.parallel``, Megatron-LM):
compute and parameters divided by ``tp``, each layer's 2 + 2 all-reduces of its ``2 s b h``
output over ``tp_bandwidth_gbs`` added to F and B, the replicated ``10 s b h`` of each layer's
activation kept whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import NamedTuple

from flexpipe.cost import parallel as par
from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.errors import ConfigError

BYTES = 2  # fp16 / bf16
MAX_COUNT = 1024  # stages / ranks of one pipeline: more is a typo (the links are n x n)


class LayerCost(NamedTuple):
    """One transformer layer, one micro-batch: FLOPs of F, B, W and activation bytes."""

    f_flops: float
    b_flops: float
    w_flops: float
    act: float
    wact: float
    params: float


@dataclass(frozen=True)
class TransformerSpec:
    """A transformer, its split into stages and the hardware it runs on."""

    layers: int
    """Transformer layers in the whole model."""
    hidden: int
    """Hidden size h."""
    heads: int
    """Attention heads a."""
    seq: int
    """Sequence length s."""
    micro_batch: int = 1
    """Micro-batch size b (sequences per micro-batch)."""
    vocab: int | None = None
    """Vocabulary size V; adds the embedding to the first stage and the head to the last."""
    device_flops: float = 312e12
    """Peak FLOP/s of one device (default: an A100's dense fp16 peak)."""
    efficiency: float = 1.0
    """Fraction of the peak reached, in (0, 1]."""
    num_stages: int | None = None
    """Pipeline stages; the layers are split evenly (earlier stages take the remainder)."""
    layers_per_stage: tuple[int, ...] | None = None
    """Explicit layers of each stage (sums to ``layers``); overrides ``num_stages``."""
    num_ranks: int | None = None
    """Ranks the communication model covers (default: one per stage)."""
    latency_ms: float = 0.0
    """Latency of one point-to-point transfer, in milliseconds."""
    bandwidth_gbs: float = math.inf
    """Link bandwidth in GB/s (1e9 bytes per second); inf means transfers cost only latency."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-LM; divides ``heads``): one rank's share of every
    stage, with the all-reduces of ``flexpipe.cost.parallel``."""
    tp_bandwidth_gbs: float = 300.0
    """Bandwidth of the tensor-parallel group's links in GB/s (default: NVLink)."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "micro_batch"):
            _positive_int(name, getattr(self, name))
        if self.vocab is not None:
            _positive_int("vocab", self.vocab)
        for name in ("num_stages", "num_ranks"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name), MAX_COUNT)
        _number("device_flops", self.device_flops, positive=True)
        _number("efficiency", self.efficiency, positive=True)
        if self.efficiency > 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {self.efficiency!r}")
        _number("latency_ms", self.latency_ms)
        _positive_int("tp", self.tp, MAX_COUNT)
        if self.heads % self.tp:
            raise ConfigError(f"tp {self.tp} does not divide the {self.heads} attention heads")
        _number("tp_bandwidth_gbs", self.tp_bandwidth_gbs, positive=True)
        if not _is_number(self.bandwidth_gbs) or not self.bandwidth_gbs > 0:
            raise ConfigError(
                f"bandwidth_gbs must be a positive number, got {self.bandwidth_gbs!r}")
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", _split_list(self))

    def split(self) -> tuple[int, ...]:
        """Layers of each stage."""
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        n = self.num_stages or 1
        if n > self.layers:
            raise ConfigError(f"cannot split {self.layers} layers over {n} stages")
        base, extra = divmod(self.layers, n)
        return tuple(base + (1 if s < extra else 0) for s in range(n))


def field_names() -> tuple[str, ...]:
    """Names of ``TransformerSpec``'s fields (the keys of a cost file's ``transformer`` table)."""
    return tuple(f.name for f in fields(TransformerSpec))


def layer_cost(spec: TransformerSpec) -> LayerCost:
    """docs/facts.md's per-layer formulas for ``spec``."""
    s, b, h, a = spec.seq, spec.micro_batch, spec.hidden, spec.heads
    return LayerCost(
        f_flops=s * b * h * (24 * h + 4 * s),
        b_flops=s * b * h * (24 * h + 8 * s),
        w_flops=24 * s * b * h * h,
        act=s * b * (34 * h + 5 * a * s),
        wact=32 * s * b * h,
        params=12 * h * h * BYTES,
    )


def stage_cost(spec: TransformerSpec, layers: int, first: bool, last: bool) -> StageCost:
    """Costs of one stage of ``layers`` layers (plus the embedding/head when first/last)."""
    lc = layer_cost(spec)
    f, b, w = lc.f_flops * layers, lc.b_flops * layers, lc.w_flops * layers
    act, wact, params = lc.act * layers, lc.wact * layers, lc.params * layers
    boundary = BYTES * spec.seq * spec.micro_batch * spec.hidden
    if spec.vocab is not None:
        table = spec.vocab * spec.hidden * BYTES
        params += table * (int(first) + int(last))
        if last:
            head = 2 * spec.seq * spec.micro_batch * spec.hidden * spec.vocab
            f, b, w = f + head, b + head, w + head
            act += 4 * spec.seq * spec.micro_batch * spec.vocab
    ms = 1e3 / (spec.device_flops * spec.efficiency)
    return _tensor_parallel(spec, layers, StageCost(
        {"F": f * ms, "B": b * ms, "W": w * ms}, act=act, wact=wact, input=boundary,
        params=params, out_bytes=boundary))


def _tensor_parallel(spec: TransformerSpec, layers: int, full: StageCost) -> StageCost:
    """One of ``spec.tp`` ranks' share of a stage (``flexpipe.cost.parallel``): every layer's
    all-reduces of the ``2 s b h``-byte boundary in F and B, and its replicated activations;
    the embedding, head and logits split over the vocabulary."""
    if spec.tp == 1:
        return full
    t, out = spec.tp, full.out_bytes
    per_ms = spec.tp_bandwidth_gbs * 1e9 / 1e3
    f, b, w = par.tp_times(full.times["F"], full.times["B"], full.times["W"], layers * out, t,
                           per_ms)
    act, wact, params = par.tp_memory(full.act, full.wact, full.params, layers * out, t)
    return StageCost({"F": f, "B": b, "W": w}, act=act, wact=wact, input=full.input,
                     params=params, out_bytes=out)


def spec_cost(spec: TransformerSpec) -> CostModel:
    """The cost model of ``spec``: one ``StageCost`` per stage and a uniform link."""
    split = spec.split()
    n = len(split)
    stages = tuple(stage_cost(spec, k, s == 0, s == n - 1) for s, k in enumerate(split))
    per_ms = spec.bandwidth_gbs * 1e9 / 1e3  # bytes per millisecond
    return CostModel(stages, Comm.uniform(spec.num_ranks or n, spec.latency_ms, per_ms))


def transformer_cost(*, layers: int, hidden: int, heads: int, seq: int, micro_batch: int = 1,
                     vocab: int | None = None, device_flops: float = 312e12,
                     efficiency: float = 1.0, num_stages: int | None = None,
                     layers_per_stage: tuple[int, ...] | None = None,
                     num_ranks: int | None = None, latency_ms: float = 0.0,
                     bandwidth_gbs: float = math.inf, tp: int = 1,
                     tp_bandwidth_gbs: float = 300.0) -> CostModel:
    """Analytic cost model of a transformer; see ``TransformerSpec`` for each argument and the
    module docstring for the formulas. Times in milliseconds, memory in bytes."""
    return spec_cost(TransformerSpec(
        layers=layers, hidden=hidden, heads=heads, seq=seq, micro_batch=micro_batch,
        vocab=vocab, device_flops=device_flops, efficiency=efficiency, num_stages=num_stages,
        layers_per_stage=layers_per_stage, num_ranks=num_ranks, latency_ms=latency_ms,
        bandwidth_gbs=bandwidth_gbs, tp=tp, tp_bandwidth_gbs=tp_bandwidth_gbs))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _positive_int(name: str, value: object, most: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if most is not None and value > most:
        raise ConfigError(f"{name} must be at most {most}, got {value!r}")


def _number(name: str, value: object, positive: bool = False) -> None:
    ok = _is_number(value) and _finite(value) and (  # type: ignore[arg-type]
        value > 0 if positive else value >= 0)  # type: ignore[operator]
    if not ok:
        kind = "positive" if positive else "non-negative"
        raise ConfigError(f"{name} must be a finite {kind} number, got {value!r}")


def _split_list(spec: TransformerSpec) -> tuple[int, ...]:
    raw = spec.layers_per_stage
    if isinstance(raw, str | bytes) or not hasattr(raw, "__iter__"):
        raise ConfigError(f"layers_per_stage must be a list of integers, got {raw!r}")
    split = tuple(raw)  # type: ignore[arg-type]
    for s, k in enumerate(split):
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"layers_per_stage[{s}] must be a non-negative integer, got {k!r}")
    if not split or sum(split) != spec.layers:
        raise ConfigError(f"layers_per_stage {list(split)} sums to {sum(split)}, "
                          f"not layers = {spec.layers}")
    if spec.num_stages is not None and spec.num_stages != len(split):
        raise ConfigError(f"layers_per_stage lists {len(split)} stages, num_stages is "
                          f"{spec.num_stages}")
    return split
