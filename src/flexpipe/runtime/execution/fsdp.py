"""FSDP over the data-parallel mesh for schedules with the DSL's AG/RS kinds (ZeroPP), on
torch's FSDP2 (``fully_shard``, through ``flexpipe.runtime.transport.engines.Sharded``).

Between uses a stage keeps only its parameters' shards (DTensors over the ``dp`` mesh: what
the optimizer steps). AG unshards them (FSDP2's all-gather); RS reduce-scatters (averages) the
gradient accumulated since the last RS into the shards' gradients and, at the last RS of the
gathered runs, frees the full parameters. With one replica the mesh has one member: the shard
is the whole parameter. HSDP (``dp_replicate`` > 1) shards over ``dp / dp_replicate`` ranks and
keeps ``dp_replicate`` copies of the shards (``check_replicate``). Under expert parallelism
the mesh is the ``dp x ep`` ranks (``mesh.Grid.fsdp_mesh``; with HSDP ``dp_replicate`` groups
of ``dp / dp_replicate x ep`` shard ranks) and the experts are left whole (FSDP2's
``ignored_params``): their gradients are averaged over the ``dp`` replicas alone after the
step, as without FSDP (in the reduce dtype under a mixed-precision policy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.ir.schedule import Schedule
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.transport.engines import Sharded, full, local
from flexpipe.runtime.transport.mesh import hsdp_shape


def uses_fsdp(ops: Sequence[object]) -> bool:
    """Whether a rank's ops gather parameters (any AG)."""
    return any(getattr(op, "kind", None) == "AG" for op in ops)


def check_replicate(schedule: Schedule, dp: int, replicate: int, flag: str) -> None:
    """HSDP's sizes: ``replicate`` (the option ``flag``) divides the ``dp`` data-parallel
    ranks, and with ``replicate`` > 1 the schedule shards something (has AG/RS)."""
    hsdp_shape(dp, replicate, flag)
    if replicate > 1 and not any(uses_fsdp(ops) for ops in schedule.ranks):
        raise ConfigError(f"{flag} = {replicate} replicates FSDP2's shards (HSDP), but schedule "
                          f"{schedule.name or '(unnamed)'} gathers nothing (no AG/RS): shard it "
                          "with fsdp (--fsdp), or use a schedule with AG/RS")


def shard_stages(stages: Mapping[int, StageModule], mesh: object,
                 mp_policy: object = None,
                 ignored: Sequence[torch.Tensor] = ()) -> dict[int, Sharded]:
    """Shard every stage of this rank with FSDP2 over the data-parallel ``mesh`` (under
    torch's ``mp_policy``: None, the parameters' own dtype), leaving ``ignored`` whole (the
    experts of expert parallelism)."""
    return {s: Sharded(s, m, mesh, mp_policy, ignored)  # type: ignore[arg-type]
            for s, m in sorted(stages.items())}


def trainable(stages: Mapping[int, StageModule],
              shards: Mapping[int, Sharded]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(what the optimizer steps, what the DP all-reduce averages): a sharded stage's shards
    (already averaged by RS), an unsharded stage's parameters and the parameters FSDP2 left
    whole in a sharded stage (``Sharded.ignored``: the experts, averaged their own way)."""
    plain: list[torch.Tensor] = [p for s, m in stages.items() if s not in shards
                                 for p in m.parameters()]
    plain += [p for sh in shards.values() for p in sh.ignored]
    return plain + [p for sh in shards.values() for p in sh.params], plain


def check_closed(shards: Mapping[int, Sharded], rank: int) -> None:
    """After a step every AG must have its RS (else gradients would be lost)."""
    open_ = [s for s, sh in shards.items() if sh.gathered]
    if open_:
        raise RunError(f"rank {rank}: stage(s) {open_} still gathered after the step: "
                       f"every AG needs an RS after its weight gradients")


def param_bytes(stages: Mapping[int, StageModule], shards: Mapping[int, Sharded]) -> float:
    """Bytes this rank holds now in parameters and their gradients, each storage once: the
    stages' current parameters (under FSDP2 the gathered ones while an AG is open, else the
    shards) and the FSDP shards themselves (a freed gathered parameter has no bytes)."""
    return held_bytes(param_tensors(stages, shards))


def param_tensors(stages: Mapping[int, StageModule],
                  shards: Mapping[int, Sharded]) -> list[torch.Tensor | None]:
    """The stages' current parameters and the FSDP shards, each with its gradient (None where
    it has none): what ``param_bytes`` counts."""
    tensors = [t for m in stages.values() for p in m.parameters() for t in (p, p.grad)]
    return tensors + [t for sh in shards.values() for p in sh.params for t in (p, p.grad)]


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> float:
    """The bytes of the storages behind ``tensors`` (DTensors: their local shards), each
    storage counted once; a freed one (no bytes) and None count nothing."""
    sizes: dict[int, int] = {}
    for t in tensors:
        storage = None if t is None else local(t).untyped_storage()
        if storage is not None and storage.nbytes():  # a freed one has no bytes (nor pointer)
            sizes[storage.data_ptr()] = storage.nbytes()
    return float(sum(sizes.values()))


def full_named(stages: Mapping[int, StageModule], grads: bool) -> dict[str, torch.Tensor]:
    """Every stage parameter (or its gradient; zeros where none) by global name: full tensors
    (DTensor shards gathered over their mesh: every rank of it calls this together), detached
    copies on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        for name, p in stage.named_global_parameters().items():
            t = p.grad if grads else p
            t = torch.zeros_like(full(p)) if t is None else full(t)
            out[name] = t.detach().cpu().clone()
    return out
