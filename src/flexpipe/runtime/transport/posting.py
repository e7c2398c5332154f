"""Posting receives off the compute thread.

Under gloo, posting a receive (``irecv``) takes the lock of the TCP pair to the peer, which the
transport's own thread holds while it reads or writes a message on that pair. On a machine whose
cores the ranks fill, that thread can be descheduled holding the lock, and a rank posting its
next receive waits for it: measured on 2 ranks of 2 cores, posting took 0.3-7 ms per receive and
up to 90 ms of a 1.4 s ZB-V step, on the rank whose channel carries both directions' messages.
``Poster`` hands the posts to one helper thread (in order, so every channel still posts in its
sender's order; the call releases the GIL) and the compute thread goes on; the op that uses a
message first waits for its post. Under CUDA (NCCL) posting is asynchronous already, and is made
on the receive stream the calling thread holds, so it stays inline.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from flexpipe.runtime.transport import comm


class Posted:
    """The transport works of one set of receives from global rank ``peer``: posted, or the
    post still queued on the posting thread."""

    def __init__(self, peer: int, works: list[object] | None = None,
                 future: Future[list[object]] | None = None) -> None:
        self.peer, self._works, self._future = peer, works, future

    def done(self) -> bool:
        """Whether the receives are posted (their works exist)."""
        return self._works is not None or (self._future is not None and self._future.done())

    def works(self, timeout: datetime.timedelta | None = None) -> list[object]:
        """The works, waiting up to ``timeout`` (None: for ever) for the post first; what the
        post raised is raised here, and a post that does not end in time is a ``PeerError``
        naming the peer."""
        if self._works is None:
            assert self._future is not None
            seconds = None if timeout is None else timeout.total_seconds()
            try:
                self._works = self._future.result(seconds)
            except FutureTimeout:
                raise comm.PeerError(f"posting a receive from rank {self.peer} did not end in "
                                     f"{seconds:.0f}s (is that rank stuck?)", self.peer,
                                     timed_out=True) from None
        return self._works


_POOL: tuple[int, ThreadPoolExecutor] | None = None
"""This process's posting thread, with the pid that made it (a forked child makes its own)."""


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(1, "flexpipe-recv"))
    return _POOL[1]


class Poster:
    """Posts receives on the process's one posting thread (``threaded``), or inline."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded

    def irecv(self, buffers: Sequence[torch.Tensor], peer: int, group: object | None) -> Posted:
        """Post a receive into each of ``buffers`` from global rank ``peer``, after every
        receive this process posted before."""
        def post() -> list[object]:
            return [comm.irecv(b, peer, group) for b in buffers]
        if not self.threaded:
            return Posted(peer, works=post())
        return Posted(peer, future=_pool().submit(post))
