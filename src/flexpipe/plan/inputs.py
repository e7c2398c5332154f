"""Model and cluster files for the planner (JSON or TOML), validated with errors that name the
file and the key path, e.g. ``cluster.json: links.bandwidth_gbs[2][0]: must be positive``.

Model file (one of ``layers``, ``transformer`` or ``preset``)::

    {"name": "my-net", "global_batch": 32, "micro_batch_sizes": [1, 2, 4],
     "default": {"F": 1.0, "B": 1.0, "W": 0.8, "act": 2e6, "out_bytes": 1e6, "params": 4e8},
     "layers": [{"name": "embed", "F": 0.1}, {}, {}, {"name": "head", "F": 2.0}]}

  Layer fields, per sample (micro-batch size 1): ``F``, ``B``, ``W`` in ms (required, here or in
  ``default``), ``act`` and ``wact`` (activation bytes held after F, and after B until W),
  ``out_bytes`` (its output), ``params`` (static bytes: weights, gradients, optimizer state), and
  ``name``. ``transformer``: ``layers``, ``hidden``, ``heads``, ``seq`` and optionally ``vocab``,
  ``device_flops``, ``efficiency`` (embedding + blocks + head from the formulas). ``preset``: a
  name of ``flexpipe.plan.presets.MODELS``. ``global_batch`` defaults to 64 and
  ``micro_batch_sizes`` to [1, 2, 4].

Cluster file (``devices`` + ``links``, or ``preset``)::

    {"name": "2 boxes", "devices": [{"memory_gb": 80, "speed": 1.0}, ...],
     "links": {"bandwidth_gbs": [[...], ...], "latency_ms": 0.01}}

  ``devices`` is a list, or ``num_devices`` with one ``device`` table for all. ``links``:
  ``bandwidth_gbs`` (GB/s, positive, "inf" allowed) and ``latency_ms`` (default 0), each one
  number or an n x n matrix (row = sender; need not be symmetric). ``preset``:
  ``{"topology": "nodes", "devices": 16, "seed": 0}`` (topologies of ``presets.CLUSTERS``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flexpipe.cost import checks as ck
from flexpipe.cost.transformer import TransformerSpec
from flexpipe.errors import ConfigError
from flexpipe.plan.presets import CLUSTERS, MODELS, cluster_preset, model_preset, transformer_layers
from flexpipe.plan.problem import GBS, Cluster, Device, Layer, Model

MODEL_KEYS = ("name", "global_batch", "micro_batch_sizes", "default", "layers", "transformer",
              "preset")
LAYER_KEYS = ("name", "F", "B", "W", "act", "wact", "out_bytes", "params")
SPEC_KEYS = ("layers", "hidden", "heads", "seq", "vocab", "device_flops", "efficiency")
CLUSTER_KEYS = ("name", "devices", "num_devices", "device", "links", "preset")
DEVICE_KEYS = ("memory_gb", "speed")
LINK_KEYS = ("bandwidth_gbs", "latency_ms")
PRESET_KEYS = ("topology", "devices", "seed")
MAX_LAYERS = 4096
MAX_DEVICES = 1024


def read_file(path: str | Path, what: str) -> tuple[Any, str]:
    """The parsed content of a ``.json`` or ``.toml`` file, and its name for messages."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise ConfigError(f"{path}: unknown {what} file type {path.suffix!r} (expected .json "
                          f"or .toml)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read {what} file ({exc})") from None
    return ck.read_data(text, suffix, str(path)), str(path)


def load_model(path: str | Path) -> Model:
    """Read a model file (module docstring)."""
    data, source = read_file(path, "model")
    return model_from_dict(data, source=source)


def load_cluster(path: str | Path) -> Cluster:
    """Read a cluster file (module docstring)."""
    data, source = read_file(path, "cluster")
    return cluster_from_dict(data, source=source)


# --- model --------------------------------------------------------------------------------------

def model_from_dict(data: Any, *, source: str = "model") -> Model:
    """Build a ``Model`` from the file form; ``source`` names the file in errors."""
    top = ck.table(data, source, "")
    ck.known(top, MODEL_KEYS, source, "")
    name = ck.text(top.get("name", Path(source).stem), source, "name")
    kinds = [k for k in ("layers", "transformer", "preset") if k in top]
    if len(kinds) != 1:
        raise ConfigError(f"{source}: give exactly one of 'layers', 'transformer' or 'preset' "
                          f"(got {kinds or 'none'})")
    if "default" in top and kinds[0] != "layers":
        raise ConfigError(f"{source}: 'default' only goes with 'layers'")
    batch = ck.count(top.get("global_batch", 64), source, "global_batch", 1 << 20)
    raw_sizes = top.get("micro_batch_sizes", [1, 2, 4])
    if not isinstance(raw_sizes, list) or not raw_sizes:
        raise ConfigError(f"{source}: micro_batch_sizes: must be a non-empty list of positive "
                          f"integers, got {ck.show(raw_sizes)}")
    sizes = tuple(ck.count(v, source, f"micro_batch_sizes[{i}]", 1 << 20)
                  for i, v in enumerate(raw_sizes))
    layers = _LAYER_SOURCES[kinds[0]](top, source)
    try:
        return Model(name, layers, batch, sizes, _heads(top, kinds[0]))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _heads(top: Mapping[str, Any], kind: str) -> int | None:
    """Attention heads of a transformer or preset model (they bound tensor parallelism)."""
    if kind == "transformer":
        return int(top["transformer"]["heads"])
    if kind == "preset":
        return model_preset(top["preset"]).heads
    return None


def _explicit_layers(top: Mapping[str, Any], source: str) -> tuple[Layer, ...]:
    default = _layer_fields(top.get("default", {}), source, "default")
    raw = ck.tables(top["layers"], source, "layers", "layer", MAX_LAYERS, " layers")
    return tuple(_layer({**default, **_layer_fields(t, source, f"layers[{i}]")}, i, source)
                 for i, t in enumerate(raw))


def _layer_fields(raw: Any, source: str, where: str) -> dict[str, Any]:
    table = ck.table(raw, source, where)
    ck.known(table, LAYER_KEYS, source, where)
    return {k: (ck.text(v, source, f"{where}.{k}") if k == "name"
                else ck.nonneg(v, source, f"{where}.{k}")) for k, v in table.items()}


def _layer(fields: dict[str, Any], i: int, source: str) -> Layer:
    missing = [k for k in ("F", "B", "W") if k not in fields]
    if missing:
        raise ConfigError(f"{source}: layers[{i}]: missing time {missing[0]!r} (give it in the "
                          f"layer or in 'default')")
    return Layer(fields.get("name", f"layer{i}"), fields["F"], fields["B"], fields["W"],
                 fields.get("act", 0.0), fields.get("wact", 0.0), fields.get("out_bytes", 0.0),
                 fields.get("params", 0.0))


def _transformer_layers(top: Mapping[str, Any], source: str) -> tuple[Layer, ...]:
    table = ck.table(top["transformer"], source, "transformer")
    ck.known(table, SPEC_KEYS, source, "transformer")
    missing = [k for k in ("layers", "hidden", "heads", "seq") if k not in table]
    if missing:
        raise ConfigError(f"{source}: transformer: missing {', '.join(map(repr, missing))}")
    if isinstance(table["layers"], int) and table["layers"] > MAX_LAYERS:
        raise ConfigError(f"{source}: transformer.layers: at most {MAX_LAYERS}")
    for key in ("hidden", "heads", "seq", "vocab"):
        if key in table:
            ck.count(table[key], source, f"transformer.{key}", 1 << 24)
    try:
        spec = TransformerSpec(**{k: table[k] for k in table})
    except ConfigError as exc:
        raise ConfigError(f"{source}: transformer: {exc}") from None
    return transformer_layers(spec)


def _preset_layers(top: Mapping[str, Any], source: str) -> tuple[Layer, ...]:
    name = top["preset"]
    if not isinstance(name, str) or name not in MODELS:
        raise ConfigError(f"{source}: preset: unknown model preset {ck.show(name)} (known: "
                          f"{', '.join(MODELS)})")
    return model_preset(name).layers


_LAYER_SOURCES = {"layers": _explicit_layers, "transformer": _transformer_layers,
                  "preset": _preset_layers}


# --- cluster ------------------------------------------------------------------------------------

def cluster_from_dict(data: Any, *, source: str = "cluster") -> Cluster:
    """Build a ``Cluster`` from the file form; ``source`` names the file in errors."""
    top = ck.table(data, source, "")
    ck.known(top, CLUSTER_KEYS, source, "")
    if "preset" in top:
        extra = [k for k in top if k not in ("preset", "name")]
        if extra:
            raise ConfigError(f"{source}: 'preset' cannot be combined with {extra[0]!r}")
        return _cluster_preset(top["preset"], source)
    name = ck.text(top.get("name", Path(source).stem), source, "name")
    devices = _devices(top, source)
    n = len(devices)
    links = ck.table(top.get("links", {}), source, "links")
    ck.known(links, LINK_KEYS, source, "links")
    if "bandwidth_gbs" not in links and n > 1:
        raise ConfigError(f"{source}: links: missing 'bandwidth_gbs'")
    bw = ck.matrix(links.get("bandwidth_gbs", "inf"), n, source, "links.bandwidth_gbs",
                   ck.bandwidth, diagonal=0.0)
    lat = ck.matrix(links.get("latency_ms", 0.0), n, source, "links.latency_ms", ck.nonneg,
                    diagonal=0.0)
    bw = tuple(tuple(math.inf if a == b else v * GBS for b, v in enumerate(row))
               for a, row in enumerate(bw))
    lat = tuple(tuple(0.0 if a == b else v for b, v in enumerate(row))
                for a, row in enumerate(lat))
    return Cluster(name, devices, lat, bw)


def _devices(top: Mapping[str, Any], source: str) -> tuple[Device, ...]:
    if "devices" in top:
        if "num_devices" in top or "device" in top:
            raise ConfigError(f"{source}: give 'devices' or 'num_devices' with 'device', not "
                              f"both")
        raw = ck.tables(top["devices"], source, "devices", "device", MAX_DEVICES)
        return tuple(_device(t, source, f"devices[{i}]") for i, t in enumerate(raw))
    if "num_devices" not in top:
        raise ConfigError(f"{source}: give a 'devices' list, 'num_devices' or a 'preset'")
    n = ck.count(top["num_devices"], source, "num_devices", MAX_DEVICES)
    one = _device(top.get("device", {}), source, "device")
    return (one,) * n


def _device(raw: Any, source: str, where: str) -> Device:
    table = ck.table(raw, source, where)
    ck.known(table, DEVICE_KEYS, source, where)
    memory = ck.nonneg(table.get("memory_gb", 80.0), source, f"{where}.memory_gb")
    speed = ck.nonneg(table.get("speed", 1.0), source, f"{where}.speed")
    if speed <= 0:
        raise ConfigError(f"{source}: {where}.speed: must be positive, got {speed!r}")
    return Device(memory * 1e9, speed)


def _cluster_preset(raw: Any, source: str) -> Cluster:
    table = ck.table(raw, source, "preset")
    ck.known(table, PRESET_KEYS, source, "preset")
    topo = table.get("topology")
    if not isinstance(topo, str) or topo not in CLUSTERS:
        raise ConfigError(f"{source}: preset.topology: must be one of {', '.join(CLUSTERS)}, "
                          f"got {ck.show(topo)}")
    n = ck.count(table.get("devices", 8), source, "preset.devices", MAX_DEVICES)
    seed = ck.count(table.get("seed", 0), source, "preset.seed", 1 << 31, least=0)
    return cluster_preset(topo, n, seed)
