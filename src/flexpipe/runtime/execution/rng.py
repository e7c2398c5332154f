"""Random numbers that do not depend on the schedule: with a seed, every layer's forward on a
micro-batch draws from a generator seeded by (seed, step, micro-batch, the layer's global name),
so dropout masks are the same whatever the schedule, the partition, the rank, the number of
ranks or a recompute (R) of the forward — and the same as on one device. Without a seed, the
global generator runs on; a recompute then restores the state its forward started from.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Draw:
    """Where a forward's random numbers come from: the run's seed, step and micro-batch."""

    seed: int
    step: int
    mb: int

    def layer_seed(self, layer: str) -> int:
        """The seed of ``layer``'s forward on this micro-batch."""
        key = f"{self.seed}/{self.step}/{self.mb}/{layer}".encode()
        return (zlib.crc32(key) << 32 | zlib.adler32(key)) & _MASK


_DRAW: contextvars.ContextVar[Draw | None] = contextvars.ContextVar("flexpipe_draw",
                                                                     default=None)


@contextlib.contextmanager
def drawing(draw: Draw | None) -> Iterator[None]:
    """Forwards inside draw per layer from ``draw`` (None: from the global generator)."""
    token = _DRAW.set(draw)
    try:
        yield
    finally:
        _DRAW.reset(token)


def layer_seed(layer: str) -> int | None:
    """The seed ``layer`` must use now (None when no ``drawing`` is active)."""
    draw = _DRAW.get()
    return None if draw is None else draw.layer_seed(layer)


def _devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run with the generators of the CPU and ``device`` seeded by ``seed``, restoring them
    after."""
    with torch.random.fork_rng(devices=_devices(device)):
        torch.manual_seed(seed)
        yield


@dataclass
class Snapshot:
    """The generator state a forward started from (for an exact recompute without a seed)."""

    cpu: torch.Tensor
    device: torch.device
    cuda: torch.Tensor | None

    @classmethod
    def take(cls, device: torch.device) -> Snapshot:
        """The current state."""
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, cuda)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run with the saved state, restoring the current one after."""
        with torch.random.fork_rng(devices=_devices(self.device)):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield
