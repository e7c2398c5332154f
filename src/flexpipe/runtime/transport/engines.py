"""torch's own parallel engines, applied to one pipeline stage: FSDP2 (``fully_shard``) over the
mesh's ``dp`` dimension (or HSDP's ``(dp_replicate, dp_shard)`` mesh: all-reduce over the
first, reduce-scatter over the second; under expert parallelism the ``dp x ep`` ranks, the
experts left out: ``Sharded``'s ``ignored``) and tensor parallelism (``parallelize_module``:
DTensor) over ``tp``.

A stage with several repeated blocks (``blocks``: the GPT's transformer blocks, a Hugging Face
model's decoder layers, a user model's repeated children) has each block sharded as its own
FSDP2 unit and then the stage root (what is left: embeddings, norms, the head), as torchtitan
does; AG gathers every unit and RS reduce-scatters and frees every unit.

FlexPipe writes no collective of its own here. What it adds is *when*: FSDP2 is driven
explicitly, as torch.distributed.pipelining drives it, so that the schedule's AG and RS ops
decide when a stage's parameters are gathered and when its gradient is reduce-scattered and
the parameters freed (ZeroPP's blockwise units): ``Sharded.gather`` is ``unshard()``,
``Sharded.reduce_scatter`` runs FSDP2's post-backward with gradient sync on. Between them the
backward passes (B, W, BW) only accumulate the unsharded gradient.

A tensor-parallel plan maps module-name patterns (``fnmatch``: ``*.qkv``) to a style:
``colwise`` (the output features sharded: ``ColwiseParallel``) or ``rowwise`` (the input
features sharded, the output all-reduced: ``RowwiseParallel``), the Megatron-LM split of an
attention block and an MLP. The names are the model's own (a stage's global parameter names
without ``.weight``).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from fnmatch import fnmatchcase
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from flexpipe.errors import ConfigError, RunError

_REDISTRIBUTE = logging.getLogger("torch.distributed.tensor._redistribute")

STYLES: Mapping[str, Callable[[], ParallelStyle]] = MappingProxyType({
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
})
"""Tensor-parallel styles by the name a plan gives them."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; any other tensor itself)."""
    return t.to_local() if isinstance(t, DTensor) else t


def sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a part of a tensor spread over a mesh)."""
    return isinstance(t, DTensor)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Within: DTensor's note that a 2-D (FSDP x TP) redistribution takes two collectives is
    not shown."""
    level = _REDISTRIBUTE.level
    _REDISTRIBUTE.setLevel(logging.ERROR)
    try:
        yield
    finally:
        _REDISTRIBUTE.setLevel(level)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t`` (a DTensor gathered over its mesh: every rank of it must call;
    ``quiet``)."""
    if not isinstance(t, DTensor):
        return t
    with quiet():
        return t.full_tensor()


def assign(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into ``target``: a DTensor takes its own part (every
    rank of its mesh calls this together)."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            part = distribute_tensor(value.to(target.dtype), target.device_mesh,
                                     target.placements)
            target.to_local().copy_(part.to_local())
        else:
            target.copy_(value)


def placeholder(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor to read a checkpoint's ``shape`` into: spread as ``like`` is where it
    is a DTensor of that shape (the checkpoint then reads only this rank's part), else
    whole."""
    if isinstance(like, DTensor) and tuple(like.shape) == tuple(shape):
        return dtensor_zeros(shape, dtype=dtype, device_mesh=like.device_mesh,
                             placements=like.placements)
    return torch.empty(shape, dtype=dtype)


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (a shard of a tensor spread over a mesh)."""
    return isinstance(t, DTensor)


def fsdp_mixed_precision(param_dtype: torch.dtype,
                         reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """torch's FSDP2 policy: parameters gathered in ``param_dtype``, gradients reduced in
    ``reduce_dtype``, floating forward inputs cast to ``param_dtype``."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                cast_forward_inputs=True)


def policy_dtypes(value: object) -> tuple[torch.dtype | None, ...] | None:
    """(param, reduce, output) dtypes of torch's ``MixedPrecisionPolicy`` ``value`` (None where
    it leaves one unset); None for anything else."""
    if not isinstance(value, MixedPrecisionPolicy):
        return None
    return value.param_dtype, value.reduce_dtype, value.output_dtype


def module_names(global_params: Mapping[str, torch.Tensor], root: nn.Module) -> dict[str, str]:
    """Local module path -> the model's name for it, for every module of ``root`` holding a
    ``weight`` (``global_params``: the model's name of every parameter of ``root``)."""
    by_id = {id(p): name for name, p in global_params.items()}
    out: dict[str, str] = {}
    for path, mod in root.named_modules():
        weight = mod._parameters.get("weight")
        if weight is not None and id(weight) in by_id:
            out[path] = by_id[id(weight)].removesuffix(".weight")
    return out


def tensor_parallel(root: nn.Module, mesh: DeviceMesh, plan: Mapping[str, str],
                    names: Mapping[str, str], where: str) -> list[str]:
    """Parallelize the modules of ``root`` whose model name (``names``: local path -> name)
    matches a pattern of ``plan`` over ``mesh``; returns the model names parallelized."""
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        raise ConfigError(f"tensor-parallel plan: unknown style(s) {bad} (known: "
                          f"{', '.join(STYLES)})")
    chosen: dict[str, ParallelStyle] = {}
    done: list[str] = []
    for path, name in names.items():
        style = next((s for pat, s in plan.items() if fnmatchcase(name, pat)), None)
        if style is not None:
            chosen[path] = STYLES[style]()
            done.append(name)
    if chosen:
        try:
            parallelize_module(root, mesh, chosen)
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            raise ConfigError(f"{where}: tensor parallelism failed on {done}: {exc}") from exc
    return done


def blocks(root: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a stage, each its own FSDP2 unit: at the shallowest depth where
    two or more modules named by an index hold parameters (an ``nn.ModuleList``'s entries, a
    traced model's ``layers.3``), those whose type a sibling shares; none where they share
    parameters (a tied weight would sit in two units) or no two exist."""
    level = [root]
    while level:
        indexed = [(m, [c for n, c in m.named_children() if n.isdigit() and _holds(c)])
                   for m in level]
        if sum(len(kids) for _, kids in indexed) >= 2:
            found = [c for _, kids in indexed for c in _repeated(kids)]
            return found if _disjoint(found) else []
        level = [c for m in level for c in m.children()]
    return []


def _holds(module: nn.Module) -> bool:
    """Whether ``module`` (or a module inside it) has a parameter."""
    return any(True for _ in module.parameters())


def _repeated(kids: list[nn.Module]) -> list[nn.Module]:
    """The modules of ``kids`` whose type another of them has."""
    counts = Counter(type(c) for c in kids)
    return [c for c in kids if counts[type(c)] >= 2]


def _disjoint(units: list[nn.Module]) -> bool:
    """Whether no parameter is in two of ``units``."""
    ids = [id(p) for u in units for p in u.parameters()]
    return len(ids) == len(set(ids))


class Sharded:
    """One stage's parameters sharded by FSDP2 over the data-parallel mesh (1-D, or HSDP's
    2-D ``(dp_replicate, dp_shard)``), gathered and reduce-scattered when the schedule says
    (AG / RS): each repeated block (``blocks``) its own unit, then the stage root.
    ``gathered`` counts the AGs not yet closed by an RS; the parameters are freed at the RS
    closing the last one. ``ignored``: parameters FSDP2 leaves whole and alone (torch's
    ``ignored_params``: the experts of expert parallelism, different on every ``ep`` rank);
    their gradients accumulate in ``.grad`` as without FSDP."""

    def __init__(self, stage: int, module: nn.Module, mesh: DeviceMesh,
                 mp_policy: MixedPrecisionPolicy | None = None,
                 ignored: Iterable[torch.Tensor] = ()) -> None:
        self.stage = stage
        policy = mp_policy or MixedPrecisionPolicy()
        inner = blocks(module)
        apart = {id(p) for p in ignored}
        mine = [p for p in module.parameters() if id(p) in apart]
        left = set(mine) or None
        for block in inner:
            fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=policy,
                        ignored_params=left)
        fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=policy,
                    ignored_params=left)
        assert isinstance(module, FSDPModule)
        self.module: Any = module
        self.units: list[Any] = [module, *inner]
        """The FSDP2 modules: the stage root, then its blocks (each gathered by AG)."""
        self.ignored = mine
        """The parameters left whole (``ignored``; averaged by the caller, not by RS)."""
        self.params = [p for p in module.parameters() if p.requires_grad
                       and id(p) not in apart]
        """The sharded parameters (what the optimizer steps)."""
        self.gathered = 0
        self._sync(False, reshard=False)

    def _sync(self, on: bool, reshard: bool) -> None:
        """Gradient reduce-scatter (and HSDP's all-reduce) on or off in FSDP2's post-backward
        of every unit; free after it or not."""
        self.module.set_requires_gradient_sync(on)  # recursive: the blocks too
        self.module.set_reshard_after_backward(reshard)
        self.module.set_is_last_backward(on)

    def gather(self) -> None:
        """AG: all-gather the full parameters of every unit, the gathers issued together (a
        second AG before the RS changes nothing)."""
        handles = [unit.unshard(async_op=True) for unit in self.units]
        for handle in handles:
            if handle is not None:
                handle.wait()
        self.gathered += 1

    def accumulate(self) -> None:
        """Under a mixed-precision policy: add the compute-dtype gradient the gathered
        parameters hold into the gradient accumulated in the reduce dtype, as FSDP2's own
        post-backward does between reduce-scatters (W's products land after it ran)."""
        if self.gathered == 0:
            return
        for param in self._fsdp_params():
            param.accumulate_unsharded_grad_if_needed()
            param.to_accumulated_grad_if_needed()

    def _groups(self) -> list[Any]:
        """Every FSDP2 parameter group of the stage (root and blocks)."""
        states = [fully_shard.state(u) for u in self.units]  # type: ignore[attr-defined]
        return [group for each in states for group in each._fsdp_param_groups]

    def _fsdp_params(self) -> list[Any]:
        return [p for group in self._groups() for p in group.fsdp_params]

    def reduce_scatter(self) -> None:
        """RS: reduce-scatter (average over the replicas; HSDP: reduce-scatter over the shards,
        all-reduce over the replica groups) the gradient accumulated since the last RS into
        the shards' gradients; free the full parameters when no AG is left open."""
        if self.gathered == 0:
            raise RunError(f"stage {self.stage}: RS without an AG before it")
        self._sync(True, reshard=self.gathered == 1)
        for group in reversed(self._groups()):  # backward order: the blocks, then the root
            group.post_backward()
        state = fully_shard.state(self.module)  # type: ignore[attr-defined]
        state._root_post_backward_final_callback()
        self._sync(False, reshard=False)
        self.gathered -= 1
