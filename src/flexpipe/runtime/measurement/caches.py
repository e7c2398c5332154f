"""Timing a pass with the CPU caches cold, as it runs after another stage's pass.

A profile repeats one stage's passes on the same micro-batch, so its weights, inputs and saved
activations stay in the caches from one pass to the next: a pass that follows its own stage's
pass on its rank runs that way in training too (1F1B's and ZB-H1's every pass, one stage per
rank). Where another stage ran on the rank since (a V-shape's ranks alternate two), the pass
finds that stage's data in the caches instead, and on a CPU the ranks share the last-level
cache. So on a CPU the profiler also times every pass with the caches evicted first
(``Evictor``: it writes a buffer twice the size of the largest cache, outside the timed
interval), and the simulator gives those ``cold`` times to a pass when another stage's pass
ran on its rank since its stage's previous pass of its kind (``StageCost.switched_time``,
``flexpipe.sim.compile``). The ranks take turns at the cold rounds, the others running their
passes untimed (``profile._cold_rounds``): an eviction beside another rank's timed pass slows
that pass, which training does not.

Measured on Hugging Face GPT-2 at hidden 256 (2 gloo ranks, m = 8, scratch probes): ZB-V's
passes ran 1.02-1.07x their hot times and 0.97-1.03x their cold ones, also those right after
their own stage's pass (its W after its B: 1.03x hot, 1.00x cold), where 1F1B's ran 0.99-1.03x
their hot times. Over six profile launches the predicted ZB-H1 / ZB-V was 0.963-0.995 with that
rule, 0.984-1.011 with cold times after a switch only; the step pairs measured 0.973-0.994.
GPUs are profiled hot only: their passes stream working sets far larger than their L2.

The size evicted is the largest cache sysfs reports, or ``FLEXPIPE_CACHE_BYTES`` (a size like
``32MiB``) where set: a virtual machine may report its host's whole last-level cache (480 MiB
on the 2-core development machine, so 960 MiB written, about 0.1 s, before every cold pass),
more than its cores ever hold of a stage's data. The test suite states 8 MiB: no test reads
the times.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flexpipe.cost.limits import parse
from flexpipe.errors import ConfigError

SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
FALLBACK = 64 << 20
"""The cache size (bytes) assumed where the system does not say (no sysfs: not Linux)."""
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
CACHE_ENV = "FLEXPIPE_CACHE_BYTES"
"""The cache size to evict, stated (a size like ``32MiB``), instead of the largest sysfs says."""


def _size(text: str) -> int:
    """Bytes of a sysfs cache size (``32768K``, ``2M``, ``512``); 0 when unreadable."""
    text = text.strip()
    scale = _UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else 0


def stated_cache() -> int | None:
    """Bytes ``FLEXPIPE_CACHE_BYTES`` states (None when unset); a ConfigError naming the
    variable for anything but one positive size."""
    text = os.environ.get(CACHE_ENV, "").strip()
    if not text:
        return None
    try:
        limit = parse(text)
    except ConfigError:
        limit = None
    if limit is None or limit.unit != "bytes" or len(limit.values) != 1 \
            or not limit.values[0] >= 1:
        raise ConfigError(f"{CACHE_ENV}={text!r}: expected one size like 32MiB")
    return int(limit.values[0])


def largest_cache(root: Path = SYSFS) -> int:
    """Bytes of this CPU's largest cache (its last level), from sysfs; ``FALLBACK`` where the
    system does not say."""
    sizes = [_size(p.read_text()) for p in root.glob("index*/size") if p.is_file()]
    return max(sizes, default=0) or FALLBACK


class Evictor:
    """Called before a timed pass: on a CPU, writes a buffer of twice the largest cache (or
    ``cache_bytes``, or the stated ``FLEXPIPE_CACHE_BYTES``) so the pass starts with none of
    its data cached; on other devices, nothing."""

    def __init__(self, device: torch.device, cache_bytes: int | None = None) -> None:
        self.buffer: torch.Tensor | None = None
        if device.type == "cpu":
            stated = stated_cache() if cache_bytes is None else cache_bytes
            size = 2 * (stated if stated is not None else largest_cache())
            self.buffer = torch.zeros(size // 4, dtype=torch.float32)

    @property
    def active(self) -> bool:
        """Whether calling it evicts anything (a CPU)."""
        return self.buffer is not None

    def __call__(self) -> None:
        """Evict: read and write every line of the buffer (a plain write could bypass the
        caches)."""
        if self.buffer is not None:
            self.buffer.add_(1.0)


_CPU: Evictor | None = None


def evictor(device: torch.device) -> Evictor:
    """The process's evictor for ``device`` (one buffer per process on a CPU)."""
    global _CPU
    if device.type != "cpu":
        return Evictor(device)
    if _CPU is None:
        _CPU = Evictor(device)
    return _CPU
