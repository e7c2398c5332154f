"""The one module that talks to ``torch.distributed``: process-group set-up with timeouts,
point-to-point transfers of tensor tuples whose shapes are learned at run time, data-parallel
gradient all-reduce and barriers.

Transfers are keyed by a *channel* (direction, producer stage, consumer stage) and a
micro-batch; each message gets its own tag, so receives may be posted in any order and early.
The first message on a channel is preceded by a small metadata message (count, dtypes, shapes);
the receiver learns the shapes from it once and preallocates buffers afterwards. Every wait has
a timeout: a dead or stuck peer makes the waiting rank fail with a message naming the peer and
the transfer, never hang.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from flexpipe.errors import FlexPipeError

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool)
META_SIZE = 256
MAX_TENSORS = 32

Channel = tuple[int, int, int]  # (direction 0 = activations / 1 = gradients, src stage, dst stage)
Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


class PeerError(FlexPipeError):
    """A transfer with another rank failed or timed out; ``peer`` is that rank (global index,
    None when unknown) and ``timed_out`` whether it did not answer in time."""

    def __init__(self, message: str, peer: int | None = None, timed_out: bool = False) -> None:
        super().__init__(message)
        self.peer, self.timed_out = peer, timed_out

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (str(self), self.peer, self.timed_out)


BACKEND_ENV = "FLEXPIPE_BACKEND"
"""Environment variable naming the backend (gloo, nccl, auto) when ``init`` is given none."""


def pick_backend(backend: str | None = None) -> str:
    """``gloo`` or ``nccl``: ``backend``, else ``$FLEXPIPE_BACKEND``, else gloo; ``auto`` is
    nccl when CUDA is available."""
    name = (backend or os.environ.get(BACKEND_ENV) or "gloo").lower()
    if name == "auto":
        name = "nccl" if torch.cuda.is_available() else "gloo"
    if name not in ("gloo", "nccl"):
        raise FlexPipeError(f"unknown backend {name!r} (gloo, nccl, auto)")
    if name == "nccl" and not torch.cuda.is_available():
        raise FlexPipeError("backend nccl needs CUDA, and torch sees no GPU here")
    return name


def init(rank: int, world: int, *, init_method: str | None = None, backend: str | None = None,
         timeout_s: float = 60.0) -> None:
    """Join the process group (``env://`` when ``init_method`` is None, as under torchrun);
    fails after ``timeout_s`` when a rank never arrives. Under NCCL, CUDA tensors go over NCCL
    and CPU tensors (point-to-point transfers, barriers) over gloo."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    name = pick_backend(backend)
    if name == "nccl":
        torch.cuda.set_device(local_device(rank))
    try:
        dist.init_process_group("cpu:gloo,cuda:nccl" if name == "nccl" else name,
                                init_method=init_method or "env://", rank=rank,
                                world_size=world, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - reported with context
        raise PeerError(f"rank {rank}: could not join the {world}-rank process group within "
                        f"{timeout_s:.0f}s ({type(exc).__name__}: {exc})") from exc


def local_device(rank: int) -> torch.device:
    """This process's GPU: ``cuda:LOCAL_RANK`` (torchrun), else rank modulo the GPU count."""
    index = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    return torch.device("cuda", index)


def device() -> torch.device:
    """Where this rank computes: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return local_device(dist.get_rank())
    return torch.device("cpu")


def shutdown() -> None:
    """Leave the process group."""
    if dist.is_initialized():
        dist.destroy_process_group()


def env_launch() -> tuple[int, int] | None:
    """(rank, world size) when launched by torchrun (its environment variables are set)."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def barrier(timeout_s: float) -> None:
    """All ranks meet here (gloo monitored barrier: names a missing rank on timeout; under
    NCCL an all-reduce of a CPU tensor over gloo)."""
    try:
        if dist.get_backend() != "gloo":
            dist.all_reduce(torch.zeros(1))
            return
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001
        missing = re.search(r"Rank (\d+) failed to pass monitoredBarrier", str(exc))
        raise PeerError(f"rank {dist.get_rank()}: barrier failed: {exc}",
                        int(missing.group(1)) if missing else None) from exc


def ping_pong(buf: torch.Tensor, peer: int, first: bool) -> None:
    """One blocking round trip of ``buf`` with ``peer``: send then receive when ``first``,
    else receive then send (for measuring a link)."""
    if first:
        dist.send(buf, peer)
        dist.recv(buf, peer)
    else:
        dist.recv(buf, peer)
        dist.send(buf, peer)


def new_groups(layouts: Sequence[Sequence[int]]) -> list[object]:
    """Sub-groups (every rank must call this with the same layouts in the same order)."""
    return [dist.new_group(list(ranks)) for ranks in layouts]


def all_reduce_mean(tensors: Sequence[torch.Tensor], group: object, size: int) -> None:
    """Average ``tensors`` in place over ``group`` (``size`` ranks), as one flat buffer."""
    if size == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)  # type: ignore[arg-type]
    flat /= size
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def all_gather_flat(out: torch.Tensor, part: torch.Tensor, group: object, size: int) -> None:
    """``out`` = the ``size`` members' ``part``s concatenated in group-rank order (FSDP AG)."""
    if size == 1:
        out.copy_(part)
        return
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, part.contiguous(), group=group)


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group: object,
                        size: int) -> None:
    """``out`` = this member's slice of the sum of every member's ``full`` (FSDP RS)."""
    if size == 1:
        out.copy_(full)
        return
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full.contiguous(), group=group)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _encode(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    vals = [len(tensors)]
    for t in tensors:
        vals += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    if len(vals) > META_SIZE or len(tensors) > MAX_TENSORS:
        raise FlexPipeError(f"a stage boundary carries {len(tensors)} tensors with too many "
                            f"dimensions to describe (limit {MAX_TENSORS} tensors)")
    return torch.tensor(vals + [0] * (META_SIZE - len(vals)), dtype=torch.int64)


def _decode(meta: torch.Tensor) -> Meta:
    vals = meta.tolist()
    out, i = [], 1
    for _ in range(vals[0]):
        dtype, ndim = DTYPES[vals[i]], vals[i + 1]
        out.append((dtype, tuple(vals[i + 2:i + 2 + ndim])))
        i += 2 + ndim
    return tuple(out)


@dataclass
class Incoming:
    """A posted (or, before the shapes are known, deferred) receive of a tensor tuple."""

    p2p: P2P
    channel: Channel
    mb: int
    src: int
    works: list[object] = field(default_factory=list)
    buffers: list[torch.Tensor] | None = None

    def post(self) -> None:
        """Post the receives (shapes known)."""
        meta = self.p2p.shapes[self.channel]
        self.buffers = [torch.empty(shape, dtype=dt, device=self.p2p.device) for dt, shape in meta]
        self.works = [dist.irecv(b, self.src, tag=self.p2p.tag(self.channel, self.mb, i))
                      for i, b in enumerate(self.buffers)]

    def get(self) -> tuple[torch.Tensor, ...]:
        """Wait for the tensors (learning the shapes first if needed)."""
        if self.buffers is None:
            self.p2p.learn(self.channel, self.src)
            self.post()
        for w in self.works:
            self.p2p.wait(w, f"{_what(self.channel)} of micro-batch {self.mb} from rank "
                             f"{self.src}", self.src)
        assert self.buffers is not None
        return tuple(self.buffers)


def _what(channel: Channel) -> str:
    kind = "activations" if channel[0] == 0 else "gradients"
    return f"{kind} of stage {channel[1]} -> {channel[2]}"


class P2P:
    """Point-to-point transfers between the ranks of one pipeline. ``ranks[i]`` is the global
    rank of pipeline rank i."""

    def __init__(self, ranks: Sequence[int], num_stages: int, microbatches: int,
                 timeout_s: float, device: torch.device) -> None:
        self.ranks = list(ranks)
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        self.shapes: dict[Channel, Meta] = {}
        self.sent_meta: set[Channel] = set()
        self.sends: list[tuple[object, object]] = []

    def tag(self, channel: Channel, mb: int, index: int) -> int:
        """Unique tag of one tensor of one message (mb = microbatches is the metadata)."""
        d, a, b = channel
        key = ((d * self.num_stages + a) * self.num_stages + b) * (self.microbatches + 1) + mb
        return key * MAX_TENSORS + index

    def send(self, tensors: Sequence[torch.Tensor], channel: Channel, mb: int, dst: int) -> None:
        """Start sending ``tensors`` to pipeline rank ``dst`` (completes in the background)."""
        peer = self.ranks[dst]
        if channel not in self.sent_meta:
            meta = _encode(tensors).to(self.device)
            self.sends.append((dist.isend(meta, peer, tag=self.tag(channel, self.microbatches,
                                                                   0)), meta))
            self.sent_meta.add(channel)
        for i, t in enumerate(tensors):
            t = t.detach().to(self.device).contiguous()  # staged on the host under NCCL
            self.sends.append((dist.isend(t, peer, tag=self.tag(channel, mb, i)), t))

    def recv(self, channel: Channel, mb: int, src: int) -> Incoming:
        """A receive from pipeline rank ``src``; posted now when the shapes are known."""
        inc = Incoming(self, channel, mb, self.ranks[src])
        if channel in self.shapes:
            inc.post()
        return inc

    def learn(self, channel: Channel, peer: int) -> None:
        """Receive the metadata of ``channel`` (blocking, with the timeout)."""
        if channel in self.shapes:
            return
        meta = torch.empty(META_SIZE, dtype=torch.int64, device=self.device)
        work = dist.irecv(meta, peer, tag=self.tag(channel, self.microbatches, 0))
        self.wait(work, f"the shapes of {_what(channel)} from rank {peer}", peer)
        self.shapes[channel] = _decode(meta.cpu())

    def wait(self, work: object, what: str, peer: int | None = None) -> None:
        """Wait for one transfer (with global rank ``peer``), turning a failure or timeout into
        a clear ``PeerError``."""
        try:
            ok = work.wait(self.timeout)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001
            raise PeerError(f"rank {dist.get_rank()}: waiting for {what} failed "
                            f"(is that rank dead or stuck?): {exc}", peer) from exc
        if ok is False:
            raise PeerError(f"rank {dist.get_rank()}: timed out after "
                            f"{self.timeout.total_seconds():.0f}s waiting for {what}", peer,
                            timed_out=True)

    def flush(self) -> None:
        """Wait for every send started so far."""
        for work, _ in self.sends:
            self.wait(work, "a send to finish")
        self.sends.clear()

    def reap(self) -> None:
        """Drop sends that have completed (frees their buffers)."""
        if len(self.sends) > 64:
            self.sends = [(w, t) for w, t in self.sends
                          if not w.is_completed()]  # type: ignore[attr-defined]
