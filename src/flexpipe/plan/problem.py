"""The planner's inputs as plain data: a model's per-layer profile, the devices and the links.

Units: times in milliseconds, memory and message sizes in bytes, bandwidth in bytes per
millisecond inside (GB/s in files: 1 GB/s = 1e6 bytes/ms), latency in milliseconds.
A layer's times, activation and output bytes are for one sample (micro-batch size 1) and scale
linearly with the micro-batch size; ``params`` is what the layer holds all along whatever the
batch (weights, gradients and optimizer state).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from flexpipe.cost.model import Comm
from flexpipe.errors import ConfigError

GBS = 1e6  # bytes per millisecond in one GB/s


@dataclass(frozen=True)
class Layer:
    """One layer of the model, per sample: F/B/W times, activation held after F (``act``) and
    after B until W (``wact``), bytes of its output (``out_bytes``) and static ``params``."""

    name: str
    f: float
    b: float
    w: float
    act: float
    wact: float
    out_bytes: float
    params: float

    @property
    def work(self) -> float:
        """F + B + W of one sample."""
        return self.f + self.b + self.w


@dataclass(frozen=True)
class Model:
    """A layer sequence, the global batch and the micro-batch sizes allowed; ``heads``, when
    known (transformer models), bounds the tensor-parallel degree (it must divide them)."""

    name: str
    layers: tuple[Layer, ...]
    global_batch: int
    micro_batch_sizes: tuple[int, ...]
    heads: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError(f"model {self.name!r}: needs at least one layer")
        if not self.choices():
            raise ConfigError(f"model {self.name!r}: no micro-batch size in "
                              f"{list(self.micro_batch_sizes)} divides the global batch "
                              f"{self.global_batch}")

    def choices(self) -> tuple[tuple[int, int], ...]:
        """Allowed (micro-batch size, micro-batches) pairs: sizes that divide the global batch."""
        return tuple((b, self.global_batch // b) for b in sorted(set(self.micro_batch_sizes))
                     if b <= self.global_batch and self.global_batch % b == 0)


@dataclass(frozen=True)
class Device:
    """A device: its memory capacity in bytes and its speed factor (2.0 runs layers twice as
    fast as the profile)."""

    memory: float
    speed: float = 1.0


@dataclass(frozen=True)
class Cluster:
    """Devices and the links between them: ``latency[a][b]`` ms and ``bandwidth[a][b]`` bytes/ms
    from a to b (need not be symmetric)."""

    name: str
    devices: tuple[Device, ...]
    latency: tuple[tuple[float, ...], ...]
    bandwidth: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        n = len(self.devices)
        if n < 1:
            raise ConfigError(f"cluster {self.name!r}: needs at least one device")
        for what, mat in (("latency", self.latency), ("bandwidth", self.bandwidth)):
            if len(mat) != n or any(len(row) != n for row in mat):
                raise ConfigError(f"cluster {self.name!r}: {what} must be a {n}x{n} matrix")
        for a in range(n):
            for b in range(n):
                if a != b and not self.bandwidth[a][b] > 0:
                    raise ConfigError(f"cluster {self.name!r}: bandwidth[{a}][{b}] must be "
                                      f"positive")

    @property
    def size(self) -> int:
        """Number of devices."""
        return len(self.devices)

    @cached_property
    def comm(self) -> Comm:
        """The links in the cost model's vocabulary (``Comm``: ``link`` gives a transfer's
        latency and link occupancy, ``time`` their sum)."""
        return Comm(self.latency, self.bandwidth)

    def comm_on(self, path: Sequence[int]) -> Comm:
        """The links between the devices of ``path``, as ranks 0..len(path)-1."""
        return Comm(tuple(tuple(self.latency[a][b] for b in path) for a in path),
                    tuple(tuple(self.bandwidth[a][b] for b in path) for a in path))

    def time(self, a: int, b: int, nbytes: float) -> float:
        """Time to send ``nbytes`` from device a to device b (0 on the same device)."""
        return self.comm.time(a, b, nbytes)

    def round_trip(self, a: int, b: int, nbytes: float) -> float:
        """``nbytes`` from a to b and back (an activation forward, its gradient backward)."""
        return self.comm.time(a, b, nbytes) + self.comm.time(b, a, nbytes)

    def uniform_bandwidth(self) -> Cluster:
        """This cluster as a planner that assumes uniform links sees it: every link has the mean
        bandwidth and mean latency (PipeDream's assumption)."""
        n = self.size
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
        if not pairs:
            return self
        bw = len(pairs) / sum(1.0 / self.bandwidth[a][b] for a, b in pairs)
        lat = sum(self.latency[a][b] for a, b in pairs) / len(pairs)
        return Cluster(f"{self.name} (uniform links)", self.devices,
                       square(n, lat, 0.0), square(n, bw, math.inf))


def square(n: int, value: float, diagonal: float) -> tuple[tuple[float, ...], ...]:
    """An n x n matrix of ``value`` with ``diagonal`` on the diagonal."""
    return tuple(tuple(diagonal if a == b else value for b in range(n)) for a in range(n))
