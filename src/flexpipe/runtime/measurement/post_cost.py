"""The compute thread's time per transfer, measured as training pays it (``Comm.post``).

Under gloo a rank's compute thread posts each send and each receive itself, between its ops,
and on a CPU whose cores the ranks fill, the transport's threads moving a message take a core
from a compute thread. Both fall between a pipeline step's ops, once per transfer: measured on
2 ranks of 2 cores (GPT-2, hidden 256), a compute op started 0.02 ms after the one before it,
but 0.2-0.45 ms after a send or a receive post. A schedule that cuts the model into more
stages (a V-shape) posts more transfers and pays it more often; the simulator charges
``Comm.post`` per send and per receive (``flexpipe.sim.compile``).

``post_time`` measures it with every rank doing the same at the same time: blocks of forward
passes of the rank's stages, each pass with a receive from the previous rank posted before it
and a send to the next rank after it (as the executor posts them), alternating with blocks of
the same passes alone. Per stage, the median pass with its posts less the median pass alone
is one send and one receive: the post is half of it, averaged over the rank's stages (a
median per stage, as one rank's passes differ by stage and a shared machine has spikes).
Under NCCL the host posts ahead of the GPU: 0.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexpipe.runtime.measurement.measure import median
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.posting import Poster

PASSES = 8
"""Forward passes per block (a pipeline step's receives per stage at m = 8)."""

PAIRS = 8
"""Pairs of blocks (with transfers, without) whose median difference is the result."""


def post_time(passes: Sequence[Callable[[], Any]], nbytes: int, barrier_s: float,
              pairs: int = PAIRS) -> float:
    """The compute thread's time (ms) per send or receive of ``nbytes``, every rank of the
    process group calling this together with its own ``passes`` (module docstring); 0 under
    NCCL, on one rank, or when some rank has nothing to run (it would only wait)."""
    world = comm.world_size()
    if comm.is_nccl() or world < 2:
        return 0.0
    sizes = comm.all_gather_object(nbytes if passes else -1)
    if min(sizes) < 0:
        return 0.0
    me = comm.my_rank()
    link = _Link((me + 1) % world, (me - 1) % world, max(max(sizes), 4))
    posting: list[list[float]] = [[] for _ in passes]
    alone: list[list[float]] = [[] for _ in passes]
    for pair in range(pairs + 1):  # the first pair warms the channel up
        comm.barrier(barrier_s)
        got = _block(passes, link)
        comm.barrier(barrier_s)
        if pair:
            _keep(posting, got)
            _keep(alone, _block(passes, None))
    extra = [median(w) - median(a) for w, a in zip(posting, alone, strict=True) if w and a]
    return max(sum(extra) / len(extra) / 2, 0.0) if extra else 0.0


def _keep(into: list[list[float]], got: Sequence[tuple[int, float]]) -> None:
    for k, ms in got:
        into[k].append(ms)


class _Link:
    """Sends to rank ``to``, receives from rank ``of``, one float32 message of ``nbytes``."""

    def __init__(self, to: int, of: int, nbytes: int) -> None:
        self.to, self.of = to, of
        self.data = torch.zeros(nbytes // 4, device=comm.device())
        self.poster = Poster(threaded=True)
        self.sends: list[object] = []
        self.recvs: list[Any] = []

    def receive(self) -> None:
        """Post one receive, as the executor does (a fresh buffer, posted off this thread)."""
        buf = torch.empty_like(self.data)
        self.recvs.append(self.poster.irecv([buf], self.of, None))

    def send(self) -> None:
        """Start one send."""
        self.sends.append(comm.isend(self.data.detach().contiguous(), self.to, None))

    def finish(self, timeout_s: float) -> None:
        """Wait for every transfer of the block."""
        limit = datetime.timedelta(seconds=timeout_s)
        for posted in self.recvs:
            for work in posted.works(limit):
                comm.wait(work, limit, "a receive of the posting measurement", self.of)
        for work in self.sends:
            comm.wait(work, limit, "a send of the posting measurement", self.to)
        self.sends, self.recvs = [], []


def _block(passes: Sequence[Callable[[], Any]], link: _Link | None) -> list[tuple[int, float]]:
    """(pass index, ms) of ``PASSES`` passes taking ``passes`` in turn, each timed with a
    receive posted before it and a send after it when ``link`` is given; the waits for the
    transfers come after, untimed."""
    out = []
    for k in range(PASSES):
        t0 = time.perf_counter()
        if link is not None:
            link.receive()
        passes[k % len(passes)]()
        if link is not None:
            link.send()
        out.append((k % len(passes), (time.perf_counter() - t0) * 1e3))
    if link is not None:
        link.finish(120.0)
    return out
