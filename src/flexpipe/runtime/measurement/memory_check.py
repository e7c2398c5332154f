"""Refusing a run that cannot fit, before any process starts: the schedule is simulated with the
model's real memory sizes (one forward of every stage on one micro-batch, in bytes) and unit
times, and every rank whose simulated peak exceeds the limit is named with the amount over.
A rank's static memory counts its weights, their gradients and the optimizer's state
(``ckdir.state_copies`` copies of the weights). Under a mixed-precision policy the stages are
measured computing as the run computes (bfloat16 activations) and the static memory counts the
bfloat16 compute copies and the float32 masters, gradients and optimizer state
(``precision.static_bytes``)."""

from __future__ import annotations

import torch

from flexpipe.cost.limits import LimitLike, MemLimit
from flexpipe.cost.model import SR_KEYS, Comm, CostModel, StageCost
from flexpipe.errors import ConfigError
from flexpipe.ir.lower import lower
from flexpipe.runtime.execution.precision import measured_as_run, static_bytes
from flexpipe.runtime.execution.segments import build_graph_stages, plan_stages, run_graph
from flexpipe.runtime.measurement.sizes import stage_memory
from flexpipe.runtime.models.kinds import make_batch, model_segments
from flexpipe.runtime.processes.ckdir import state_copies
from flexpipe.runtime.processes.train import Job
from flexpipe.sim.engine import simulate


def memory_cost(job: Job) -> CostModel:
    """A cost model of ``job``'s stages with measured memory sizes (bytes) and unit times."""
    num_stages = job.schedule.num_stages
    segments, loss_fn = model_segments(job.model)
    stages = build_graph_stages(segments, job.partition, num_stages)
    graph = plan_stages(segments, job.partition, num_stages).graph
    policy = job.train.mixed_precision
    measured_as_run(stages, policy, graph.sinks())
    (inputs, target), = make_batch(job.model, 0, 1)
    with torch.no_grad():
        xs = run_graph(stages, graph, inputs)[0]
    copies = 2 + state_copies(job.train.optimizer, job.train.momentum)
    costs = []
    for s in range(num_stages):
        loss = (lambda out: loss_fn(*out, target)) if s in graph.sinks() else None
        size = stage_memory(stages[s], xs[s], loss, s in graph.sources())
        costs.append(StageCost({"F": 1.0, "B": 1.0, "W": 1.0}, act=size["act"],
                               wact=size["wact"], input=size["input"],
                               params=static_bytes(size["params"], copies, policy),
                               out_bytes=size["out_bytes"],
                               **{k: size[k] for k in SR_KEYS}))
    return CostModel(tuple(costs), Comm.uniform(job.schedule.num_ranks))


def peaks(job: Job, cost: CostModel | None = None) -> tuple[float, ...]:
    """Simulated peak memory (bytes) of every pipeline rank of ``job`` (``cost``: its
    ``memory_cost``, when already built)."""
    cost = cost or memory_cost(job)
    return simulate(lower(job.schedule), cost).metrics().peak_memory


def check_memory(job: Job, limit: LimitLike) -> None:
    """A ``ConfigError`` naming every rank whose simulated peak exceeds its ``limit`` (a
    ``flexpipe.cost.limits`` limit: bytes, M_B of this model, or a number of bytes), and by
    how much; None when all fit."""
    cost = memory_cost(job)
    bound = MemLimit.of(limit).per_rank(job.schedule.num_ranks, cost)
    over = [(r, peak, bound[r]) for r, peak in enumerate(peaks(job, cost)) if peak > bound[r]]
    if over:
        lines = [f"rank {r}: simulated peak {size(peak)} is {size(peak - cap)} over the "
                 f"limit of {size(cap)}" for r, peak, cap in over]
        limits = sorted({size(cap) for _, _, cap in over})
        raise ConfigError(f"schedule {job.schedule.name!r} does not fit in {', '.join(limits)} "
                          f"per rank (refused before the run):\n" + "\n".join(lines))


def size(nbytes: float) -> str:
    """Bytes in words: ``1.50 MiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
