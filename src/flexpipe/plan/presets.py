"""Preset clusters and models for the planner.

Clusters (``cluster_preset(name, n)``), with figures of current hardware:

- ``nodes``: nodes of 8 devices, NVLink inside a node (300 GB/s, 5 us) and InfiniBand between
  nodes (25 GB/s, i.e. one 200 Gb/s NIC per node, 20 us).
- ``pcie``: a PCIe tree: 4 devices per PCIe switch (25 GB/s peer to peer, 10 us), switches meet
  at the CPU root complex (12 GB/s, 15 us), two sockets joined by the CPU interconnect, the slow
  root (6 GB/s, 30 us).
- ``ring``: a ring of direct links (50 GB/s, 8 us per hop); a transfer between devices d hops
  apart is forwarded through them: latency x d, bandwidth / d.
- ``random``: every directed link drawn at random (seeded): bandwidth log-uniform in
  5..300 GB/s, latency 5..50 us; not symmetric.
- ``mixed``: ``nodes`` where every other node holds an older device generation (0.4x the speed,
  half the memory: V100 next to A100).
- ``geo``: devices rented in several regions (decentralised training, as in Yuan et al.,
  NeurIPS 2022): regions of 4 devices, the devices listed in random (seeded) order; inside a
  region 100 Gb/s Ethernet (12.5 GB/s, 50 us), between regions a wide-area link per region pair
  drawn log-uniform in 1..10 Gb/s (0.125..1.25 GB/s), latency 5..40 ms.

Devices have 80 GB and speed 1 unless said. Models (``model_preset(name)``) come from the
transformer formulas of ``flexpipe.cost.transformer`` at 50% of an A100's 312 TFLOP/s: an
embedding layer (a gather, timed by its memory traffic at 2 TB/s; ``V h`` parameters), the
blocks, and a head layer (the ``h x V`` matrix product and the fp32 logits). Static memory is
16 bytes per parameter (fp16 weights and gradients, fp32 Adam state and master weights).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from random import Random

from flexpipe.cost.parallel import STATIC_BYTES_PER_PARAM
from flexpipe.cost.presets import GPT2_VOCAB, transformer
from flexpipe.cost.transformer import TransformerSpec, layer_cost
from flexpipe.errors import ConfigError
from flexpipe.plan.problem import GBS, Cluster, Device, Layer, Model

GB = 1e9
US = 1e-3  # one microsecond in milliseconds
HBM_BYTES_PER_MS = 2e9  # 2 TB/s of device memory bandwidth


def _links(n: int, link: Callable[[int, int], tuple[float, float]]) -> tuple[tuple, tuple]:
    """Latency and bandwidth matrices from ``link(a, b) -> (latency ms, GB/s)``."""
    lat = tuple(tuple(0.0 if a == b else link(a, b)[0] for b in range(n)) for a in range(n))
    bw = tuple(tuple(math.inf if a == b else link(a, b)[1] * GBS for b in range(n))
               for a in range(n))
    return lat, bw


def nodes(n: int, seed: int = 0, per_node: int = 8) -> Cluster:
    """Nodes of ``per_node`` devices: NVLink inside, InfiniBand between."""
    def link(a: int, b: int) -> tuple[float, float]:
        return (5 * US, 300.0) if a // per_node == b // per_node else (20 * US, 25.0)
    lat, bw = _links(n, link)
    return Cluster(f"nodes-{n}", tuple(Device(80 * GB) for _ in range(n)), lat, bw)


def pcie(n: int, seed: int = 0) -> Cluster:
    """A PCIe tree: switches of 4 devices, 2 switches per socket, sockets joined slowly."""
    def link(a: int, b: int) -> tuple[float, float]:
        if a // 4 == b // 4:
            return 10 * US, 25.0
        if a // 8 == b // 8:
            return 15 * US, 12.0
        return 30 * US, 6.0
    lat, bw = _links(n, link)
    return Cluster(f"pcie-{n}", tuple(Device(80 * GB) for _ in range(n)), lat, bw)


def ring(n: int, seed: int = 0) -> Cluster:
    """A ring of direct links; traffic between non-neighbours is forwarded hop by hop."""
    def link(a: int, b: int) -> tuple[float, float]:
        hops = min((a - b) % n, (b - a) % n)
        return 8 * US * hops, 50.0 / hops
    lat, bw = _links(n, link)
    return Cluster(f"ring-{n}", tuple(Device(80 * GB) for _ in range(n)), lat, bw)


def random_links(n: int, seed: int = 0) -> Cluster:
    """Random directed links, seeded: bandwidth log-uniform 5..300 GB/s, latency 5..50 us."""
    rnd = Random(seed)
    table = {(a, b): (rnd.uniform(5, 50) * US, math.exp(rnd.uniform(math.log(5), math.log(300))))
             for a in range(n) for b in range(n) if a != b}
    lat, bw = _links(n, lambda a, b: table[(a, b)])
    return Cluster(f"random-{n}-s{seed}", tuple(Device(80 * GB) for _ in range(n)), lat, bw)


def mixed(n: int, seed: int = 0) -> Cluster:
    """``nodes`` with every other node of 8 an older generation: speed 0.4, 40 GB."""
    base = nodes(n)
    devices = tuple(Device(40 * GB, 0.4) if (d // 8) % 2 else Device(80 * GB)
                    for d in range(n))
    return Cluster(f"mixed-{n}", devices, base.latency, base.bandwidth)


def geo(n: int, seed: int = 0, per_region: int = 4) -> Cluster:
    """Regions of ``per_region`` devices in random order: fast inside, wide-area between."""
    rnd = Random(seed)
    regions = -(-n // per_region)
    region = [d // per_region for d in range(n)]
    rnd.shuffle(region)
    wan = {(a, b): (rnd.uniform(5, 40), math.exp(rnd.uniform(math.log(0.125), math.log(1.25))))
           for a in range(regions) for b in range(a + 1, regions)}

    def link(a: int, b: int) -> tuple[float, float]:
        ra, rb = sorted((region[a], region[b]))
        return (50 * US, 12.5) if ra == rb else wan[(ra, rb)]
    lat, bw = _links(n, link)
    return Cluster(f"geo-{n}-s{seed}", tuple(Device(80 * GB) for _ in range(n)), lat, bw)


CLUSTERS: dict[str, Callable[[int, int], Cluster]] = {
    "nodes": nodes, "pcie": pcie, "ring": ring, "random": random_links, "mixed": mixed,
    "geo": geo,
}


def cluster_preset(name: str, n: int, seed: int = 0) -> Cluster:
    """Preset cluster ``name`` with ``n`` devices (see the module docstring)."""
    if name not in CLUSTERS:
        raise ConfigError(f"unknown cluster preset {name!r} (known: {', '.join(CLUSTERS)})")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
        raise ConfigError(f"cluster preset {name!r}: devices must be an integer in 1..1024, "
                          f"got {n!r}")
    return CLUSTERS[name](n, seed)


# --- models -------------------------------------------------------------------------------------

MODELS = ("gpt-1.3b", "gpt-6.7b", "gpt-13b", "gpt-64l")  # shapes: flexpipe.cost.presets
VOCAB = GPT2_VOCAB


def transformer_layers(spec: TransformerSpec) -> tuple[Layer, ...]:
    """Embedding, ``spec.layers`` blocks and the head, per sample, from the formulas."""
    one = TransformerSpec(layers=spec.layers, hidden=spec.hidden, heads=spec.heads,
                          seq=spec.seq, device_flops=spec.device_flops,
                          efficiency=spec.efficiency)
    ms = 1e3 / (one.device_flops * one.efficiency)
    lc = layer_cost(one)
    s, h, v = spec.seq, spec.hidden, spec.vocab or VOCAB
    boundary = 2.0 * s * h
    table = STATIC_BYTES_PER_PARAM * v * h
    gather = 2 * boundary / HBM_BYTES_PER_MS  # a lookup reads and writes its output once
    embed = Layer("embed", gather, gather, gather, boundary, 0.0, boundary, table)
    block = Layer("block", lc.f_flops * ms, lc.b_flops * ms, lc.w_flops * ms, lc.act, lc.wact,
                  boundary, STATIC_BYTES_PER_PARAM * 12.0 * h * h)
    head_t = 2.0 * s * h * v * ms
    head = Layer("head", head_t, head_t, head_t, 4.0 * s * v + boundary, boundary, 4.0, table)
    blocks = tuple(Layer(f"block{i}", block.f, block.b, block.w, block.act, block.wact,
                         block.out_bytes, block.params) for i in range(spec.layers))
    return (embed, *blocks, head)


def model_preset(name: str, global_batch: int = 64,
                 micro_batch_sizes: tuple[int, ...] = (1, 2, 4)) -> Model:
    """Preset model ``name`` (``MODELS``): embedding + blocks + head at 50% of an A100."""
    if name not in MODELS:
        raise ConfigError(f"unknown model preset {name!r} (known: {', '.join(MODELS)})")
    spec = transformer(name, vocab=VOCAB)
    return Model(name, transformer_layers(spec), global_batch, micro_batch_sizes, spec.heads)
