"""Expert parallelism: the experts of each mixture-of-experts layer sharded over the mesh's
``ep`` dimension, tokens dispatched to the ranks owning their experts and combined back with
all-to-all (torch's ``all_to_all_single``, differentiable and timed: ``transport.exchange``).

An *experts module* is the part of a MoE layer after the router, with Hugging Face's contract
(Mixtral, Qwen2-MoE, DeepSeek-V3 and the other MoE families of the installed transformers):
``forward(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)``, the sum over
each token's k experts of the expert's output times its routing weight. An expert-parallel plan
maps module-name patterns (``fnmatch``, the model's own names) to how that module holds its E
experts:

- ``stacked``: every parameter of its own holds the experts along its first dimension (Hugging
  Face's ``gate_up_proj`` / ``down_proj``); each rank keeps its E / ep rows, and the module's
  ``num_experts`` says E / ep;
- ``list``: an ``nn.ModuleList`` of E experts; each rank keeps its E / ep experts' parameters,
  the others' are dropped (the list keeps its length, so the names stay the model's).

The router stays replicated and routes the rank's own tokens; the sharded module's forward then
counts the (token, expert) pairs per expert, exchanges the counts, sends each pair's token to
the rank owning its expert, runs the module on what it received (each token with its one local
expert, weight 1), sends the outputs back and combines them with the routing weights. Every
step is differentiable: the backward of each all-to-all is the reverse all-to-all, so the
expert-parallel ranks of a stage must run its forward and backward passes in the same order
(every rank of a stage runs the same schedule).

*Lanes*: a sharded module may be given several process groups over the same ``ep`` ranks; a
forward runs its all-to-alls on the group of the lane it runs in (``expert_lane``, 0 by
default), and its backward, torch's reverse exchange, on the same one. An overlapped pair runs
one micro-batch's forward beside another's backward (``runtime.execution.overlap``): with the
two on different lanes their collectives never meet on one group, so every ``ep`` rank matches
them however the two passes interleave.

A shard's parameters are ordinary tensors everywhere: under a mixed-precision policy they
compute on bfloat16 copies of float32 masters (``runtime.execution.precision``: the exchanges
carry bfloat16), and under FSDP2 they are left whole (``fully_shard``'s ``ignored_params``)
while the replicated weights around them are sharded over the ``dp x ep`` ranks
(``runtime.execution.fsdp``; under HSDP over the ``dp / dp_replicate x ep`` ranks of each
replica group, all-reduced across the groups). ``check_layout`` names what expert parallelism
does not run with yet (tensor parallelism and HSDP together).

With tensor parallelism (``tp`` > 1) the experts stay whole on every ``tp`` rank, as torchtitan
runs expert parallelism beside tensor parallelism when the experts are not split themselves:
the ``ep`` groups are formed per ``(dp, pp, tp)`` coordinate (the mesh's ``ep`` sub-mesh), the
``tp`` ranks of a pipeline rank see the same tokens, so each dispatches within its own
coordinate's group and computes the same expert gradients; the layers around them split by
the tensor-parallel plan, which must match no module of an experts module (``holder``).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.transport.exchange import counts, exchange


@dataclass(frozen=True)
class Shard:
    """One experts module's share on this rank."""

    name: str
    """The module's name in the model."""
    experts: int
    """E, the experts of the whole layer."""
    ep: int
    rank: int
    """This rank's index along ``ep``: it owns experts ``rank * E/ep .. (rank+1) * E/ep - 1``."""
    offset: int
    """What the local forward's expert ids add to a local index (``list``: the first owned
    expert; ``stacked``: 0, its parameters hold only the owned rows)."""
    params: tuple[torch.Tensor, ...]
    """The experts' parameters this rank holds (their gradients are averaged over ``dp``
    alone: every ``ep`` rank's tokens reached them through the all-to-all)."""
    stacked: bool
    """Whether ``params`` are this rank's rows of stacked wholes (gathered by ``full``)."""

    @property
    def local(self) -> int:
        """Experts per rank."""
        return self.experts // self.ep


def _stacked(module: nn.Module, name: str, ep: int, rank: int) -> Shard:
    """Keep this rank's rows of every parameter of ``module`` (experts along dimension 0)."""
    own = [(n, p) for n, p in module._parameters.items() if p is not None]
    sizes = {int(p.shape[0]) for _, p in own if p.dim()}
    if not own or len(sizes) != 1 or any(p.dim() == 0 for _, p in own):
        raise ConfigError(f"expert-parallel plan: {name!r} ({type(module).__name__}) is not "
                          "'stacked': its own parameters must all hold the experts along their "
                          f"first dimension (found {[(n, tuple(p.shape)) for n, p in own]})")
    experts = sizes.pop()
    lo, hi = _owned(name, experts, ep, rank)
    kept = []
    for n, p in own:
        part = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
        setattr(module, n, part)
        kept.append(part)
    if hasattr(module, "num_experts"):
        setattr(module, "num_experts", hi - lo)  # noqa: B010 - an attribute, not a submodule
    return Shard(name, experts, ep, rank, 0, tuple(kept), True)


def _listed(module: nn.Module, name: str, ep: int, rank: int) -> Shard:
    """Drop the parameters of the experts of ``module``'s ``nn.ModuleList`` this rank does not
    own (their places stay, holding no parameters)."""
    lists = [m for m in module.children() if isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError(f"expert-parallel plan: {name!r} ({type(module).__name__}) is not "
                          f"'list': it needs one nn.ModuleList of experts, it has {len(lists)}")
    experts = lists[0]
    lo, hi = _owned(name, len(experts), ep, rank)
    for k in range(len(experts)):
        if not lo <= k < hi:
            experts[k] = nn.Module()  # a place holder: the expert lives on another rank
    return Shard(name, len(experts), ep, rank, lo, tuple(experts[lo:hi].parameters()), False)


STYLES: Mapping[str, Callable[[nn.Module, str, int, int], Shard]] = types.MappingProxyType({
    "stacked": _stacked,
    "list": _listed,
})
"""Expert-parallel styles by the name a plan gives them: module, name, ep, rank -> its shard."""


def _owned(name: str, experts: int, ep: int, rank: int) -> tuple[int, int]:
    if experts % ep:
        raise ConfigError(f"expert-parallel plan: {name!r} has {experts} experts, which "
                          f"ep = {ep} does not divide")
    per = experts // ep
    return rank * per, (rank + 1) * per


_LANE: contextvars.ContextVar[int] = contextvars.ContextVar("flexpipe_expert_lane", default=0)


@contextlib.contextmanager
def expert_lane(lane: int) -> Iterator[None]:
    """Run the forwards inside on lane ``lane``'s group (module docstring)."""
    token = _LANE.set(lane)
    try:
        yield
    finally:
        _LANE.reset(token)


def expert_parallel(root: nn.Module, plan: Mapping[str, str], names: Mapping[str, str],
                    group: Any, ep: int, rank: int, spare: Sequence[Any] = ()) -> list[Shard]:
    """Shard the experts modules of ``root`` whose model name (``names``: local path -> name)
    matches a pattern of ``plan`` over the ``ep`` ranks of ``group``, and give each the
    dispatching forward; returns their shards. ``spare``: more groups over the same ranks,
    the lanes 1, 2, ... (``expert_lane``)."""
    bad = sorted({s for s in plan.values() if s not in STYLES})
    if bad:
        raise ConfigError(f"expert-parallel plan: unknown style(s) {bad} (known: "
                          f"{', '.join(STYLES)})")
    out = []
    for path, module in root.named_modules():
        name = names.get(path)
        style = None if name is None else next(
            (s for pat, s in plan.items() if fnmatchcase(name, pat)), None)
        if style is None or name is None:
            continue
        shard = STYLES[style](module, name, ep, rank)
        module.forward = types.MethodType(  # type: ignore[method-assign]
            _dispatching(type(module).forward, shard, (group, *spare)), module)
        out.append(shard)
    return out


def check_layout(ep: int, tp: int, dp_replicate: int) -> None:
    """A ConfigError naming what expert parallelism (``ep`` > 1) does not run with yet: tensor
    parallelism (``tp`` > 1) and HSDP (``dp_replicate`` > 1) together; each runs with it on
    its own (module docstring; HSDP: ``mesh.Grid.fsdp_mesh``). The worker and the CLI's
    checks before a launch both refuse here."""
    if ep > 1 and tp > 1 and dp_replicate > 1:
        raise ConfigError(f"expert parallelism (ep = {ep}) with tensor parallelism (tp > 1) and "
                          "HSDP (dp_replicate > 1) together is not supported yet")


def holder(name: str, plan: Mapping[str, str]) -> str | None:
    """The experts module ``plan`` matches that is module ``name`` or holds it (the first of
    its dotted prefixes a pattern matches); None if none does."""
    parts = name.split(".")
    prefixes = (".".join(parts[:k]) for k in range(1, len(parts) + 1))
    return next((p for p in prefixes if any(fnmatchcase(p, pat) for pat in plan)), None)


def planned_experts(root: nn.Module, plan: Mapping[str, str]) -> dict[str, int]:
    """The experts modules of ``root`` (a module or ``nn.ModuleList`` of layers, not yet
    shared out) that ``plan`` matches by their names in it, and how many experts each holds:
    a ``list`` module's list length, a ``stacked`` one's first dimension."""
    out: dict[str, int] = {}
    for name, module in root.named_modules():
        style = next((s for pat, s in plan.items() if fnmatchcase(name, pat)), None)
        if style == "list":
            lists = [len(m) for m in module.children() if isinstance(m, nn.ModuleList)]
            out[name] = lists[0] if lists else 0
        elif style == "stacked":
            own = [p for p in module._parameters.values() if p is not None and p.dim()]
            out[name] = int(own[0].shape[0]) if own else 0
    return out


def module_paths(root: nn.Module, global_names: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Local module path -> the model's name for it, for every module of ``root`` owning a
    parameter (``global_names``: the model's name of every parameter of ``root``)."""
    by_id = {id(p): name for name, p in global_names.items()}
    out: dict[str, str] = {}
    for path, module in root.named_modules():
        for pname, p in module.named_parameters(recurse=True):
            if id(p) in by_id:
                out[path] = by_id[id(p)].removesuffix("." + pname)
                break
    return out


def _dispatching(local_forward: Callable[..., torch.Tensor], shard: Shard,
                 groups: Sequence[Any]) -> Callable[..., torch.Tensor]:
    """The forward of a sharded experts module: dispatch, local experts, combine, on the
    group of the current lane."""

    def forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        group = _lane_group(groups, shard)
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs by expert, so by owning rank
        sent = torch.bincount(flat, minlength=shard.experts)
        got = torch.empty_like(sent)
        counts(got, sent, group)  # got[src * L + j]: src's pairs for j
        send_split = sent.view(shard.ep, shard.local).sum(1).tolist()
        recv_split = got.view(shard.ep, shard.local).sum(1).tolist()
        received = exchange(hidden[order // k], recv_split, send_split, group)
        ids = torch.arange(shard.local, device=flat.device).repeat(shard.ep)
        ids = torch.repeat_interleave(ids, got) + shard.offset
        ones = torch.ones(len(ids), 1, dtype=top_k_weights.dtype, device=hidden.device)
        done = local_forward(module, received, ids[:, None], ones)
        back = exchange(done, send_split, recv_split, group)
        pairs = back[torch.argsort(order)].view(tokens, k, -1)
        return (pairs * top_k_weights.to(pairs.dtype)[..., None]).sum(1)

    return forward


def _lane_group(groups: Sequence[Any], shard: Shard) -> Any:
    """The group of the current lane; a lane the module has no group for is refused."""
    lane = _LANE.get()
    if not 0 <= lane < len(groups):
        raise ConfigError(f"experts module {shard.name!r}: a forward on expert lane {lane}, "
                          f"but it has {len(groups)} group(s) over its ep ranks")
    return groups[lane]


def full(t: torch.Tensor, shards: Sequence[Shard], group: Any) -> torch.Tensor:
    """The whole of ``t``: this rank's rows of a ``stacked`` parameter gathered over the ``ep``
    ranks of ``group`` (every one of them calls this together); any other tensor itself."""
    shard = next((sh for sh in shards if sh.stacked and any(t is p for p in sh.params)), None)
    if shard is None:
        return t
    parts = [torch.empty_like(t) for _ in range(shard.ep)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts)
