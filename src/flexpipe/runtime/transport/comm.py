"""The one module that talks to ``torch.distributed``: process-group set-up with timeouts,
point-to-point primitives (``isend``/``irecv`` with no tag: matched in posting order, as NCCL
matches them; the pipeline's transport on top of them is ``flexpipe.runtime.transport.p2p``),
waits that turn a dead or stuck peer into an error naming it, data-parallel gradient
all-reduce, FSDP gathers, barriers, and checkpoints through ``torch.distributed.checkpoint``
(DCP: every rank writes its own file, one metadata file names every key). The groups FlexPipe
makes beside the default one, and how long they live, are ``groups``'.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flexpipe.errors import ConfigError, FlexPipeError, RunError


class PeerError(RunError):
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
    """Join the process group (``env://`` when ``init_method`` is None, as under torchrun; a
    group of one process meets in an in-memory store, without a port); fails after
    ``timeout_s`` when a rank never arrives. Under NCCL, CUDA tensors go over NCCL and CPU
    tensors (point-to-point transfers, barriers) over gloo."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    name = pick_backend(backend)
    if name == "nccl":
        torch.cuda.set_device(local_device(rank))
    try:
        where: dict[str, Any] = {"store": dist.HashStore()} if world == 1 and \
            init_method is None and not os.environ.get("MASTER_ADDR") else \
            {"init_method": init_method or "env://"}
        dist.init_process_group("cpu:gloo,cuda:nccl" if name == "nccl" else name, rank=rank,
                                world_size=world, timeout=timeout, **where)
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


def post_done() -> object:
    """Tell every rank this one is done, without waiting: an asynchronous all-reduce whose work
    completes once every rank has posted it (``all_done``)."""
    return dist.all_reduce(torch.ones(1), async_op=True)


def all_done(work: object) -> bool:
    """Whether every rank has posted ``post_done``'s all-reduce ``work``."""
    return bool(work.is_completed())  # type: ignore[attr-defined]


def all_reduce_mean(tensors: Sequence[torch.Tensor], group: object, size: int) -> None:
    """Average ``tensors`` in place over ``group`` (``size`` ranks), as one flat buffer."""
    if size > 1:
        _all_reduce_flat(tensors, group, size)


def all_reduce_start(tensor: torch.Tensor, group: object) -> Any:
    """Start summing ``tensor`` in place over ``group`` (asynchronously); the returned work's
    ``wait()`` completes it."""
    return dist.all_reduce(tensor, group=group, async_op=True)  # type: ignore[arg-type]


def all_reduce_sum(tensors: Sequence[torch.Tensor], group: object) -> None:
    """Sum ``tensors`` in place over ``group``, as one flat buffer."""
    _all_reduce_flat(tensors, group, None)


def all_reduce_max(tensor: torch.Tensor, group: object | None = None) -> None:
    """Element-wise maximum of ``tensor`` in place over ``group`` (None: every rank), e.g. the
    softmax maxima of a vocabulary-parallel loss."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)  # type: ignore[arg-type]


def _all_reduce_flat(tensors: Sequence[torch.Tensor], group: object,
                     divisor: int | None) -> None:
    """Sum ``tensors`` over ``group`` as one flat buffer, divided by ``divisor`` when given,
    and copy the result back in place."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)  # type: ignore[arg-type]
    if divisor is not None:
        flat /= divisor
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def leads(group: object) -> bool:
    """Whether this rank is the lowest global rank of ``group``."""
    return dist.get_rank() == min(dist.get_process_group_ranks(group))  # type: ignore[arg-type]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (without a process group: this
    process's alone)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def complaints(mine: Any) -> dict[int, Any]:
    """Every rank's complaint about the call all ranks are making (rank -> its text, or any
    picklable object; empty when none complains, i.e. every ``mine`` is None): one flag
    all-reduce over the world, the complaints gathered only when some rank has one. Every
    rank must call it at the same point. A group of one process has no one to ask (and a
    collective there leaves gloo's threads running at exit), nor has a process without a
    group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {} if mine is None else {0: mine}
    try:
        flag = torch.tensor([0 if mine is None else 1])
        dist.all_reduce(flag)
        if not int(flag.item()):
            return {}
        every = all_gather_object(mine)
    except Exception as exc:  # noqa: BLE001 - reported with context
        raise PeerError(f"rank {dist.get_rank()}: could not compare the call with the other "
                        f"ranks (is one of them dead or not calling it?): {exc}") from exc
    return {r: said for r, said in enumerate(every) if said is not None}


def is_nccl() -> bool:
    """Whether CUDA tensors go over NCCL in this process group."""
    return dist.is_initialized() and "nccl" in str(dist.get_backend())


def isend(tensor: torch.Tensor, peer: int, group: object | None) -> object:
    """Start sending ``tensor`` to global rank ``peer`` (no tag: in posting order); a
    connection that is gone is a ``PeerError`` naming the peer."""
    try:
        return dist.isend(tensor, peer, group=group)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - named with the peer
        raise PeerError(f"rank {dist.get_rank()}: could not send to rank {peer}: "
                        f"{_first_line(exc)}", peer) from exc


def irecv(tensor: torch.Tensor, peer: int, group: object | None) -> object:
    """Post the receive of ``tensor`` from global rank ``peer`` (no tag: in posting order); a
    connection that is gone is a ``PeerError`` naming the peer."""
    try:
        return dist.irecv(tensor, peer, group=group)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - named with the peer
        raise PeerError(f"rank {dist.get_rank()}: could not receive from rank {peer}: "
                        f"{_first_line(exc)}", peer) from exc


def wait(work: object, timeout: datetime.timedelta | None, what: str,
         peer: int | None = None) -> None:
    """Wait for one transfer with global rank ``peer``, turning a failure or a timeout into a
    ``PeerError`` naming ``what`` and the peer. ``timeout`` None: a CUDA transfer makes the
    current stream wait and the host goes on (NCCL's own timeout, set at ``init``, still
    ends a transfer that never comes); a timeout makes the host wait for the end."""
    try:
        ok = work.wait() if timeout is None else work.wait(timeout)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001
        raise PeerError(f"rank {dist.get_rank()}: waiting for {what} failed "
                        f"(is that rank dead or stuck?): {exc}", peer) from exc
    if ok is False:
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        raise PeerError(f"rank {dist.get_rank()}: timed out after {seconds:.0f}s waiting for "
                        f"{what}", peer, timed_out=True)


def world_size() -> int:
    """Processes in the group (0 when no process group is initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 0


def my_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


TensorInfo = tuple[tuple[int, ...], torch.dtype]
"""A checkpointed tensor's shape and dtype."""


def checkpoint_save(state: dict[str, Any], path: str) -> None:
    """Write ``state`` (flat key -> tensor or picklable object) to the DCP checkpoint at
    ``path``, every rank its own file; a key held by several ranks is written once. Every rank
    calls it together."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - named with the path
        raise RunError(f"rank {my_rank()}: could not write the checkpoint {path}: "
                       f"{_reason(exc)}") from exc


def checkpoint_load(state: dict[str, Any], path: str) -> None:
    """Read the keys of ``state`` from the DCP checkpoint at ``path``: tensors in place, other
    values replaced (pass None for them). Every rank calls it together (each with its keys).
    Nothing in the folder runs code (``safedcp``: its metadata and values as plain data)."""
    import torch.distributed.checkpoint as dcp

    from flexpipe.runtime.transport.safedcp import SafePlanner, SafeReader

    try:
        dcp.load(state, storage_reader=SafeReader(path), planner=SafePlanner())
    except (Exception, dcp.CheckpointException) as exc:  # noqa: BLE001 - named with the path
        raise RunError(f"rank {my_rank()}: could not read the checkpoint {path}: "
                       f"{_reason(exc)}") from exc


def checkpoint_keys(path: str) -> dict[str, TensorInfo | None]:
    """Every key of the DCP checkpoint at ``path``: a tensor's (shape, dtype), None for another
    object (its metadata read as plain data: ``safedcp``)."""
    import torch.distributed.checkpoint as dcp

    from flexpipe.runtime.transport.safedcp import SafeReader

    try:
        meta = SafeReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - one error naming the path
        raise ConfigError(f"no checkpoint at {path} ({type(exc).__name__}: "
                          f"{_first_line(exc)})") from None
    out: dict[str, TensorInfo | None] = {}
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, dcp.TensorStorageMetadata):
            out[key] = (tuple(item.size), item.properties.dtype)
        else:
            out[key] = None
    return out


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _reason(exc: BaseException) -> str:
    """What went wrong: a DCP failure's own errors by rank, else the first line."""
    failures = getattr(exc, "failures", None)
    if not failures:
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return "; ".join(f"rank {r}: {type(e).__name__}: {_first_line(e)}"
                     for r, (e, _) in sorted(failures.items()))
