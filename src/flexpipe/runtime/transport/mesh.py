"""The ranks of a run as one ``torch.distributed`` DeviceMesh with named dimensions.

FlexPipe lays the world out as ``dp x ep x pp x tp`` (``init_device_mesh`` with the dimension
names ``("dp", "ep", "pp", "tp")``): tensor-parallel peers are neighbours (inside a node, where
the links are fast), then the pipeline ranks of one replica, then the expert-parallel ranks
(which share each MoE layer's experts and train on data of their own), then the replicas.
Global rank ``((replica * ep + ep_rank) * pp + pipe_rank) * tp + tp_rank``; with ``ep = tp = 1``
that is the layout of a pipeline replicated ``dp`` times. A user may bring their own mesh: it
needs a ``pp`` dimension, and ``dp``, ``ep`` and ``tp`` are optional (size 1 when absent); any
order of the dimensions works, since every rank is found through the mesh's own rank table.

A ``Grid`` answers what the runtime asks of the layout: this rank's coordinates, the global rank
at other coordinates (point-to-point peers, tied-weight groups), and the sub-meshes and process
groups that torch's FSDP2 (``dp``), expert parallelism (``ep``) and tensor parallelism (``tp``)
run over. With HSDP (``dp_replicate`` > 1) FSDP2 runs over the ``dp`` sub-mesh unflattened
into ``(dp_replicate, dp_shard)`` (``Grid.fsdp_mesh``): replica group outer, shard inner, so
data-parallel index ``replicate * dp_shard + shard``. With expert parallelism (``ep`` > 1)
FSDP2 shards the replicated weights over the ``dp x ep`` ranks flattened into one dimension
(``dp_ep``: the ranks that train on data of their own for the same weights); with HSDP as well
that dimension is unflattened into ``(dp_replicate, dp_shard)``, ``dp_shard`` being the
``dp / dp_replicate x ep`` ranks of one replica group.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from flexpipe.errors import ConfigError
from flexpipe.runtime.transport import groups

DIMS = ("dp", "ep", "pp", "tp")
"""FlexPipe's mesh dimensions, outermost first."""
HSDP_DIMS = ("dp_replicate", "dp_shard")
"""The dimensions of FSDP2's HSDP mesh (the ``dp`` sub-mesh unflattened)."""


@dataclass(frozen=True)
class Grid:
    """The run's DeviceMesh and this rank's place in it."""

    mesh: DeviceMesh
    sizes: dict[str, int]
    """Size of every dimension in ``DIMS`` (1 where the mesh has none)."""
    coords: dict[str, int]
    """This rank's index along every dimension in ``DIMS`` (0 where the mesh has none)."""

    @property
    def pp(self) -> int:
        """Pipeline ranks."""
        return self.sizes["pp"]

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.sizes["dp"]

    @property
    def ep(self) -> int:
        """Expert-parallel ranks per pipeline rank (each MoE layer's experts shared out)."""
        return self.sizes["ep"]

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks per stage."""
        return self.sizes["tp"]

    def fsdp_mesh(self, replicate: int = 1) -> DeviceMesh | None:
        """The mesh FSDP2 shards over: the ``dp`` sub-mesh, or with ``replicate`` > 1 HSDP's
        2-D ``(dp_replicate, dp_shard)`` form of it (FSDP2 all-reduces over the first and
        reduce-scatters over the second); with ``ep`` > 1 the ``dp x ep`` ranks flattened
        into one dimension ``dp_ep`` (every rank holding the same replicated weights: the
        experts, which differ per ``ep`` rank, are left out of the sharding), and with HSDP
        too that dimension unflattened into ``(dp_replicate, dp_shard)``, the shard ranks
        being ``dp / dp_replicate x ep`` (data-parallel index ``replicate * dp_shard + shard``
        of the flattened one, whose index is ``dp_rank * ep + ep_rank``). Every rank calls
        this together (the 2-D and flattened meshes make process groups)."""
        sub = self._replicas_mesh() if self.ep > 1 else self.sub("dp")
        if replicate == 1 or sub is None:
            return sub
        replicate, shard = hsdp_shape(self.dp, replicate)
        return sub._unflatten(0, (replicate, shard * self.ep), HSDP_DIMS)

    def _replicas_mesh(self) -> DeviceMesh:
        """The one-dimensional mesh of the ``dp x ep`` ranks through this rank (a user's mesh
        without a ``dp`` dimension: its ``ep`` sub-mesh)."""
        names = [d for d in ("dp", "ep") if d in (self.mesh.mesh_dim_names or ())]
        if len(names) == 1:
            return self.mesh[names[0]]
        return self.mesh[tuple(names)]._flatten("dp_ep")

    def rank_at(self, **coords: int) -> int:
        """The global rank at this rank's coordinates changed by ``coords`` (e.g. ``pp=0``)."""
        where = {**self.coords, **coords}
        names = self.mesh.mesh_dim_names or ()
        index = tuple(where[n] for n in names)
        return int(self.mesh.mesh[index].item())

    def sub(self, dim: str) -> DeviceMesh | None:
        """The one-dimensional mesh along ``dim`` through this rank (None where the mesh has no
        such dimension)."""
        if dim not in (self.mesh.mesh_dim_names or ()):
            return None
        return self.mesh[dim]

    def group(self, dim: str) -> Any:
        """The process group along ``dim`` through this rank (None: size 1)."""
        sub = self.sub(dim)
        return None if sub is None or self.sizes[dim] == 1 else sub.get_group()

    def group_over(self, dims: Sequence[str]) -> Any:
        """The process group of the ranks that differ from this one only along ``dims`` (e.g.
        ``("dp", "ep")``: every rank training on data of its own for the same parameters). Every
        rank calls this together: one group per slice, created in the same order everywhere."""
        fixed = [d for d in DIMS if d not in dims]
        varying = [dict(zip(dims, at, strict=True)) for at in
                   itertools.product(*(range(self.sizes[d]) for d in dims))]
        slices = list(itertools.product(*(range(self.sizes[d]) for d in fixed)))
        made = groups.new_groups([[self.rank_at(**dict(zip(fixed, at, strict=True)), **v)
                                 for v in varying] for at in slices])
        return made[slices.index(tuple(self.coords[d] for d in fixed))]


def hsdp_shape(dp: int, replicate: int, where: str = "dp_replicate") -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` of ``dp`` data-parallel ranks in ``replicate`` replica
    groups; a ConfigError naming ``where`` (the option) unless ``replicate`` divides ``dp``."""
    if replicate < 1 or dp % replicate:
        raise ConfigError(f"{where} = {replicate} does not divide the {dp} data-parallel ranks "
                          f"(dp = dp_replicate x dp_shard)")
    return replicate, dp // replicate


def mesh_sizes(mesh: DeviceMesh) -> dict[str, int]:
    """The size of every dimension in ``DIMS`` of a user's ``mesh`` (1 where it has none); a
    ConfigError unless it has a ``pp`` dimension and no other names."""
    names = tuple(mesh.mesh_dim_names or ())
    unknown = [n for n in names if n not in DIMS]
    if "pp" not in names or unknown:
        raise ConfigError(f"the device mesh's dimensions are {names}: FlexPipe needs one named "
                          f"'pp' and knows only {DIMS}" + (f" (not {unknown})" if unknown else ""))
    return {d: (mesh.size(names.index(d)) if d in names else 1) for d in DIMS}


def build(pp: int, device: torch.device, dp: int | None = None, tp: int | None = None,
          mesh: DeviceMesh | None = None, ep: int | None = None) -> Grid:
    """The ``Grid`` of a ``dp x ep x pp x tp`` world (every rank calls this together;
    ``dp``/``ep``/``tp`` None: 1), or of the user's ``mesh`` (None: the mesh's), checked
    against ``pp`` (the schedule's ranks) and the ``dp``/``ep``/``tp`` given."""
    if mesh is None:
        mesh = groups.device_mesh(device.type, (dp or 1, ep or 1, pp, tp or 1), DIMS)
    sizes = mesh_sizes(mesh)
    coords = {d: (mesh.get_local_rank(d) if d in (mesh.mesh_dim_names or ()) else 0)
              for d in DIMS}
    wanted = {"pp": pp, "dp": dp, "ep": ep, "tp": tp}
    wrong = {d: (sizes[d], want) for d, want in wanted.items()
             if want is not None and sizes[d] != want}
    if wrong:
        raise ConfigError("the device mesh does not match the run: " + ", ".join(
            f"{d} is {have} in the mesh but {want} in the run" for d, (have, want)
            in wrong.items()))
    return Grid(mesh, sizes, coords)
