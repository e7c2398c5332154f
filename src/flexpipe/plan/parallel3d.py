"""Pipeline x data x tensor parallelism for the planner: a layout (pp, dp, tp) of the cluster's
devices, the model one pipeline replica sees under it, and the cluster that replica runs on.

Devices are grouped as Megatron-LM orders its ranks (tensor fastest, then data, then pipeline):
tensor-parallel group g holds the ``tp`` consecutive devices ``g tp .. g tp + tp - 1`` (inside one
node); replica r's pipeline position i is group ``i dp + r``. A replica is planned as a pipeline
over ``pp`` virtual devices, one per tensor-parallel group (the group's smallest memory and
speed; the links of its first device), running the layers as ``flexpipe.cost.parallel`` shards
them over ``tp`` ranks and ``dp`` replicas, on ``global_batch / dp`` samples. With ``tp = dp = 1``
the model and the cluster are the planner's own, unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexpipe.cost import parallel as par
from flexpipe.errors import ConfigError
from flexpipe.plan.problem import Cluster, Device, Layer, Model


@dataclass(frozen=True)
class Layout:
    """Pipeline, data and tensor-parallel degrees (``pp dp tp`` = the devices) and whether the
    data-parallel replicas shard their static memory (ZeRO-3 / FSDP) or hold it whole."""

    pp: int
    dp: int
    tp: int
    sharded: bool = False

    def label(self) -> str:
        """``pp=4 dp=2 tp=2`` (and ``fsdp`` when sharded)."""
        return f"pp={self.pp} dp={self.dp} tp={self.tp}" + (" fsdp" if self.sharded else "")


def node_size(cluster: Cluster) -> int:
    """Devices per node, as the links show it: the smallest k > 1 dividing the devices such that
    every block of k consecutive devices is an island (its inside links all faster than any link
    leaving it; with a single block, all alike: one node's fabric); 1 when there is none."""
    n = cluster.size
    for k in range(2, n + 1):
        if n % k == 0 and all(_island(cluster, range(i, i + k)) for i in range(0, n, k)):
            return k
    return 1


def _island(cluster: Cluster, block: range) -> bool:
    bw = cluster.bandwidth
    inside = [bw[a][b] for a in block for b in block if a != b]
    leaving = [bw[a][b] for a in block for b in range(cluster.size) if b not in block]
    if not leaving:
        return min(inside) == max(inside)
    return min(inside) > max(leaving)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_choices(model: Model, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees allowed: divisors of the node size that divide the heads."""
    return [t for t in _divisors(node_size(cluster))
            if model.heads is None or model.heads % t == 0]


def check_degrees(model: Model, cluster: Cluster, tp: int | None, dp: int | None) -> None:
    """Raise a ``ConfigError`` naming the value when a fixed ``tp`` or ``dp`` cannot be used."""
    n = cluster.size
    for name, value in (("tp", tp), ("dp", dp)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--{name} must be a positive integer, got {value!r}")
        if n % value:
            raise ConfigError(f"--{name} {value} does not divide the {n} devices of cluster "
                              f"{cluster.name!r}")
    if tp is not None:
        if model.heads is not None and model.heads % tp:
            raise ConfigError(f"--tp {tp} does not divide the {model.heads} attention heads of "
                              f"model {model.name!r}")
        if node_size(cluster) % tp:
            raise ConfigError(f"--tp {tp} does not fit in one node of cluster {cluster.name!r} "
                              f"({node_size(cluster)} devices per node, as its links show)")
    if dp is not None:
        if n % (dp * (tp or 1)):
            raise ConfigError(f"--dp {dp} x --tp {tp} does not divide the {n} devices")
        if not _batch_ok(model, dp):
            raise ConfigError(f"--dp {dp}: no micro-batch size in {list(model.micro_batch_sizes)}"
                              f" divides the {model.global_batch} / {dp} samples per replica")


def _batch_ok(model: Model, dp: int) -> bool:
    per = model.global_batch // dp
    return model.global_batch % dp == 0 and any(per % b == 0 and b <= per
                                                for b in model.micro_batch_sizes)


def layouts(model: Model, cluster: Cluster, tp: int | None = None,
            dp: int | None = None) -> list[Layout]:
    """Every (pp, dp, tp) with pp dp tp = the devices, tp inside a node and dividing the heads,
    dp dividing the global batch into micro-batches; ``tp`` / ``dp`` fix a degree."""
    check_degrees(model, cluster, tp, dp)
    n, out = cluster.size, []
    for t in [tp] if tp is not None else tp_choices(model, cluster):
        for d in [dp] if dp is not None else _divisors(n // t):
            if (n // t) % d == 0 and _batch_ok(model, d):
                out.append(Layout(n // (t * d), d, t))
    return out


def group(layout: Layout, replica: int, position: int) -> range:
    """Devices of the tensor-parallel group at ``position`` of ``replica``'s pipeline."""
    g = position * layout.dp + replica
    return range(g * layout.tp, (g + 1) * layout.tp)


def tp_bandwidth(cluster: Cluster, layout: Layout) -> float:
    """The slowest ring link inside any tensor-parallel group (inf for tp = 1)."""
    t, bw = layout.tp, cluster.bandwidth
    if t == 1:
        return math.inf
    return min(bw[g + j][g + (j + 1) % t] for g in range(0, cluster.size, t) for j in range(t))


def dp_bandwidth(cluster: Cluster, layout: Layout, position: int) -> float:
    """The slowest ring link of the data-parallel groups at pipeline ``position`` (one ring per
    tensor-parallel rank, each between the replicas' devices of that rank)."""
    d, bw = layout.dp, cluster.bandwidth
    if d == 1:
        return math.inf
    rings = [[group(layout, r, position)[j] for r in range(d)] for j in range(layout.tp)]
    return min(bw[ring[k]][ring[(k + 1) % d]] for ring in rings for k in range(d))


def shard_model(model: Model, cluster: Cluster, layout: Layout) -> Model:
    """What one pipeline replica runs per tensor-parallel rank: each layer's times, activations
    and parameters split over ``tp`` (with its all-reduces), static memory as ``dp`` replicas
    hold it, and ``global_batch / dp`` samples. ``tp = dp = 1`` returns ``model`` itself."""
    if layout.tp == 1 and layout.dp == 1:
        return model
    bw = tp_bandwidth(cluster, layout)
    return Model(model.name, tuple(_shard(x, layout, bw) for x in model.layers),
                 model.global_batch // layout.dp, model.micro_batch_sizes, model.heads)


def _shard(layer: Layer, layout: Layout, bandwidth: float) -> Layer:
    f, b, w = par.tp_times(layer.f, layer.b, layer.w, layer.out_bytes, layout.tp, bandwidth)
    act, wact, params = par.tp_memory(layer.act, layer.wact, layer.params, layer.out_bytes,
                                      layout.tp)
    return Layer(layer.name, f, b, w, act, wact, layer.out_bytes,
                 par.dp_static(params, layout.dp, layout.sharded))


def replica_cluster(cluster: Cluster, layout: Layout, replica: int) -> Cluster:
    """The ``pp`` virtual devices of ``replica``'s pipeline: one per tensor-parallel group (its
    smallest memory and speed, the links of its first device). ``tp = dp = 1``: ``cluster``."""
    if layout.tp == 1 and layout.dp == 1:
        return cluster
    groups = [group(layout, replica, i) for i in range(layout.pp)]
    devices = tuple(Device(min(cluster.devices[d].memory for d in g),
                           min(cluster.devices[d].speed for d in g)) for g in groups)
    heads = [g[0] for g in groups]
    return Cluster(f"{cluster.name} replica {replica} ({layout.label()})", devices,
                   tuple(tuple(cluster.latency[a][b] for b in heads) for a in heads),
                   tuple(tuple(cluster.bandwidth[a][b] for b in heads) for a in heads))
