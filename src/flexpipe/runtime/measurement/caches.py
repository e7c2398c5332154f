"""Timing a pass with the CPU caches cold, as it runs after another stage's pass.

A profile repeats one stage's passes on the same micro-batch, so its weights, inputs and saved
activations stay in the caches from one pass to the next: a pass that follows its own stage's
pass on its rank runs that way in training too (1F1B's and ZB-H1's every pass, one stage per
rank). A pass that follows another stage's (a V-shape's ranks alternate two) finds that
stage's data in the caches instead, and on a CPU the ranks share the last-level cache. So on a
CPU the profiler also times every pass with the caches evicted first (``Evictor``: it writes a
buffer twice the size of the largest cache, outside the timed interval), and the simulator
gives those ``cold`` times to the passes that follow another stage's
(``StageCost.switched_time``).

Measured on the 2-core development machine: a pass flushed first took 0.2-0.8 ms longer than
one timed hot (2-11%: most for the V-shape's small stages; one process, the built-in GPT at
hidden 256). On Hugging Face GPT-2 at hidden 256 (2 gloo ranks, m = 8, 22 step pairs), the
hot times predicted ZB-H1 / ZB-V at 1.020x and all-cold times at 1.042x; cold times after a
stage switch only, 0.981x, where the step pairs measured 0.978x. GPUs are profiled hot only:
their passes stream working sets far larger than their L2.
"""

from __future__ import annotations

from pathlib import Path

import torch

SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
FALLBACK = 64 << 20
"""The cache size (bytes) assumed where the system does not say (no sysfs: not Linux)."""
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    """Bytes of a sysfs cache size (``32768K``, ``2M``, ``512``); 0 when unreadable."""
    text = text.strip()
    scale = _UNITS.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    return int(digits) * scale if digits.isdigit() else 0


def largest_cache(root: Path = SYSFS) -> int:
    """Bytes of this CPU's largest cache (its last level), from sysfs; ``FALLBACK`` where the
    system does not say."""
    sizes = [_size(p.read_text()) for p in root.glob("index*/size") if p.is_file()]
    return max(sizes, default=0) or FALLBACK


class Evictor:
    """Called before a timed pass: on a CPU, writes a buffer of twice the largest cache so
    the pass starts with none of its data cached; on other devices, nothing."""

    def __init__(self, device: torch.device, cache_bytes: int | None = None) -> None:
        self.buffer: torch.Tensor | None = None
        if device.type == "cpu":
            size = 2 * (cache_bytes if cache_bytes is not None else largest_cache())
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
