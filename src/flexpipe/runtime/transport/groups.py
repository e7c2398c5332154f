"""The process groups FlexPipe makes beside the default one, and how long they live.

Sub-groups for replicas, tensor-parallel peers and tied layers (``new_groups``), a pipeline's
transfer groups (``transfer_groups``), the device meshes of a layout (``device_mesh``). Every
gloo group keeps threads and connections of its own until it is destroyed, so what a job or a
pipeline made ends with it (``own_groups``, ``drop_groups``); a failure ends a group's
connections at once, so that peers waiting on them stop (``break_group``); ``shutdown`` leaves
the default group and forgets everything made in it.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flexpipe.runtime.transport import comm

_MADE: list[object] = []
"""The sub-groups ``new_groups`` and ``transfer_groups`` made that this rank belongs to,
oldest first, until ``drop_groups`` ends them."""
_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...]], DeviceMesh] = {}
"""The device meshes ``device_mesh`` made, by layout, kept for the process group's life."""


def shutdown(settle_s: float = 5.0) -> None:
    """Leave the process group: first meet every rank (at most ``settle_s``; a rank that is
    gone is not waited for longer), so that no rank tears its connections down while a peer
    still finishes its last transfer (gloo then aborts the peer: "terminate called without an
    active exception", seen under torchrun), then destroy the group."""
    if dist.is_initialized():
        with contextlib.suppress(comm.PeerError):
            comm.barrier(settle_s)
        dist.destroy_process_group()
        _MADE.clear()
        forget_meshes()


def new_groups(layouts: Sequence[Sequence[int]]) -> list[object]:
    """Sub-groups (every rank must call this with the same layouts in the same order)."""
    return _mine([dist.new_group(list(ranks)) for ranks in layouts])


def transfer_groups() -> tuple[object | None, object | None]:
    """The groups of every rank for a pipeline's point-to-point transfers: one per direction
    (to a higher / a lower rank) under NCCL, so that each channel has its own communicator and
    stream and a send never waits behind a receive from the same peer; under gloo one group
    of its own for both (gloo matches each direction apart already), so that ``break_group``
    can end its connections without touching the default group. Every rank must call this at
    the same point. Without a process group (one rank in this process: no peer to transfer
    with) there are none: ``(None, None)``."""
    if not dist.is_initialized():
        return None, None
    ranks = list(range(dist.get_world_size()))
    if not comm.is_nccl():
        one = dist.new_group(ranks)
        _mine([one])
        return one, one
    both = dist.new_group(ranks), dist.new_group(ranks)
    _mine(list(both))
    return both


BREAK_TAG = 0x3F1A_0B52
"""The tag of the receive ``break_group`` waits on: no transfer sends with it."""


def break_group(group: object) -> None:
    """End this rank's connections in the gloo ``group`` now, so that every peer waiting on a
    transfer with it there fails at once ("Connection closed by peer") instead of waiting out
    its timeout: a receive under a tag nobody sends, waited on for a millisecond, makes gloo
    close every connection of the group (its own remedy for a timed-out wait). The group
    cannot carry anything afterwards (``drop_group``). Under NCCL nothing is done (its host
    does not block on a transfer; a rank without transfer groups has nothing to end). The
    device meshes are forgotten (``forget_meshes``): one of theirs may be this group."""
    if group is None or comm.is_nccl() or dist.get_world_size() == 1:
        return
    forget_meshes()  # a mesh may hold this group: the next pipeline makes its own
    me = dist.get_rank()
    for peer in dist.get_process_group_ranks(group):  # type: ignore[arg-type]
        if peer == me:
            continue
        with contextlib.suppress(Exception):  # the connection is closed either way
            work = dist.irecv(torch.zeros(1), peer, group=group,  # type: ignore[arg-type]
                              tag=BREAK_TAG)
            work.wait(datetime.timedelta(milliseconds=1))  # type: ignore[union-attr]


def drop_group(group: object) -> None:
    """Forget a group no transfer uses any more (``break_group``; None: there is none, and
    the default group stays)."""
    if group is None:
        return
    with contextlib.suppress(Exception):  # already gone: nothing to drop
        dist.destroy_process_group(group)  # type: ignore[arg-type]


def _mine(groups: list[object]) -> list[object]:
    """``groups`` as made, after noting those this rank belongs to in ``_MADE``."""
    _MADE.extend(g for g in dict.fromkeys(groups) if g in dist.distributed_c10d._world.pg_map)
    return groups


def made_groups() -> tuple[object, ...]:
    """The groups ``new_groups`` and ``transfer_groups`` made that are held now (``made_since``
    tells the ones made after)."""
    return tuple(_MADE)


def made_since(before: Sequence[object]) -> list[object]:
    """The groups made and held now that ``before`` (``made_groups()``) lacks, newest first."""
    old = {id(g) for g in before}
    return [g for g in reversed(_MADE) if id(g) not in old]


def drop_groups(groups: Sequence[object], timeout_s: float) -> None:
    """Destroy ``groups`` once every rank has met (a barrier: no peer still finishes a
    transfer in one). Every gloo group keeps threads and connections of its own until it is
    destroyed, so a process that builds pipeline after pipeline holds only the groups of the
    one it runs. Every rank calls this at the same point (a rank outside a group has nothing
    of it to drop)."""
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        comm.barrier(timeout_s)
    gone = {id(g) for g in groups}
    _MADE[:] = [g for g in _MADE if id(g) not in gone]
    for group in groups:
        drop_group(group)


@contextlib.contextmanager
def own_groups(timeout_s: float) -> Iterator[None]:
    """Within: the groups ``new_groups`` and ``transfer_groups`` make are destroyed on leaving
    it normally (``drop_groups``). A failure leaves them (a peer may be gone: no barrier) and
    forgets the device meshes (``forget_meshes``: their collectives may be left unmatched)."""
    before = made_groups()
    try:
        yield
    except BaseException:
        forget_meshes()
        raise
    drop_groups(made_since(before), timeout_s)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The device mesh of this layout (``init_device_mesh``, every rank together), made once
    per process group: torch takes two meshes of one layout for the same (its sharding caches
    key on the layout), so a mesh's groups live as long as the process group, and a process
    that trains job after job holds one mesh per layout."""
    key = (device_type, shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _MESHES[key]


def forget_meshes() -> None:
    """Make ``device_mesh`` build its meshes anew (after a failure that may have left their
    collectives unmatched, or once the process group is gone), and empty DTensor's caches
    of sharding and redistribution plans, which hold the old meshes (and so their groups)
    under the layout a new mesh shares."""
    if not _MESHES:
        return
    _MESHES.clear()
    with contextlib.suppress(ImportError, AttributeError):  # torch without these caches
        from torch.distributed.tensor import _redistribute, debug

        debug._clear_sharding_prop_cache()  # noqa: SLF001 - torch's advised way
        _redistribute.clear_redistribute_planner_cache()
