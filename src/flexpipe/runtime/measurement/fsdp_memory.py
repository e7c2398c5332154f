"""Parameter and gradient memory per rank under FSDP (schedules with AG/RS), predicted by the
simulator from the stages' parameter bytes, and the figure a run measures.

Between uses a stage holds its shards: 1/dp of its parameters, and from its first RS of the
step 1/dp of their gradients (the optimizer's ``zero_grad``, torch's default
``set_to_none``, frees the gradient shards between steps); under HSDP (``replicate`` groups) the
shard is 1/dp_shard = replicate/dp, each group holding a whole copy. While an AG is open (until
the RS that closes the last one) it also holds the full parameters and, from a weight gradient
(W or BW) to the next RS, their unsharded gradient. The simulator's ``params`` pool follows
exactly that (AG gathers a stage's ``params`` once however many AGs are open, a W/BW adds the
gradient, every RS frees it and the RS closing the last AG the parameters), so one simulation
with ``params`` = the stage's bytes and no activations gives each rank's curve of the gathered
part, to which the shards are added. ``benchmarks/fsdp_memory.py`` compares this with
``RankResult.param_bytes`` (every tensor's storage counted once, after every op).
"""

from __future__ import annotations

from collections.abc import Sequence

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.ir.schedule import Schedule
from flexpipe.sim.engine import simulate


def predicted_param_bytes(schedule: Schedule, stage_bytes: Sequence[float],
                          dp: int, replicate: int = 1) -> list[float]:
    """Per rank, the peak bytes of parameters and gradients under ``schedule``'s AG/RS with
    ``dp`` data-parallel ranks (HSDP: in ``replicate`` groups, each sharding over
    ``dp / replicate``), from each stage's parameter bytes ``stage_bytes``: over the
    simulated step, the gathered part plus the parameter shards plus the gradient shards of
    the stages whose first RS of the step has ended."""
    shard = dp // replicate
    stages = tuple(StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, act=0.0, wact=0.0, input=0.0,
                             params=b) for b in stage_bytes)
    trace = simulate(schedule, CostModel(stages, Comm.uniform(schedule.num_ranks)))
    owner = schedule.placement.stage_rank
    out = []
    for r, ops in enumerate(schedule.ranks):
        held = sum(b / shard for s, b in enumerate(stage_bytes) if owner[s] == r)
        first: dict[int, float] = {}
        for op, end in zip(ops, trace.ends[r], strict=True):
            if op.kind == "RS":
                first.setdefault(op.stage, end)
        scattered = [(end, stage_bytes[s] / shard) for s, end in first.items()]
        out.append(held + max(level + sum(b for at, b in scattered if at <= t)
                              for t, level in trace.memory[r]))
    return out
