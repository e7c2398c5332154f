"""A candidate plan (layer cuts, device path, schedule family, micro-batch size) and its
evaluation: the cost model it implies, a cheap estimate and lower bound for ordering and pruning,
and the simulated iteration time and memory that decide."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from flexpipe.cost.model import CostModel, StageCost
from flexpipe.errors import FlexPipeError
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.plan.problem import Cluster, Model
from flexpipe.schedules.registry import build, library
from flexpipe.sim.engine import simulate


def chunks_of(family: str) -> int:
    """Stages per device of a library family (its registry entry's placement)."""
    return library()[family].chunks(1)


def is_linear(family: str) -> bool:
    """Whether ``family`` runs one stage per device."""
    return chunks_of(family) == 1


@dataclass(frozen=True)
class Candidate:
    """Stage s runs layers ``cuts[s]:cuts[s + 1]`` on device ``path[placement rank of s]``."""

    family: str
    path: tuple[int, ...]
    cuts: tuple[int, ...]
    b: int
    m: int

    @property
    def placement(self) -> Placement:
        """Stage -> rank (rank r is device ``path[r]``), from the family's registry entry."""
        return library()[self.family].placement_for(len(self.path))

    def stage_devices(self) -> tuple[int, ...]:
        """Device of every stage."""
        return tuple(self.path[r] for r in self.placement.stage_rank)


@dataclass(frozen=True)
class Outcome:
    """A simulated candidate: iteration time, peak memory per rank and whether it fits."""

    candidate: Candidate
    makespan: float
    peak_memory: tuple[float, ...]
    fits: bool
    schedule: Schedule
    cost: CostModel


def cost_model(model: Model, cluster: Cluster, cand: Candidate) -> CostModel:
    """The cost model of ``cand``: per-stage sums of its layers at micro-batch size b, divided by
    the speed of the stage's device, and the links between the devices of the path."""
    devs = cand.stage_devices()
    stages = []
    for s, dev in enumerate(devs):
        layers = model.layers[cand.cuts[s]:cand.cuts[s + 1]]
        k = cand.b / cluster.devices[dev].speed
        prev = model.layers[cand.cuts[s] - 1].out_bytes if cand.cuts[s] else 0.0
        stages.append(StageCost(
            {"F": k * sum(x.f for x in layers), "B": k * sum(x.b for x in layers),
             "W": k * sum(x.w for x in layers)},
            act=cand.b * sum(x.act for x in layers), wact=cand.b * sum(x.wact for x in layers),
            input=cand.b * prev, params=sum(x.params for x in layers),
            out_bytes=cand.b * layers[-1].out_bytes))
    return CostModel(tuple(stages), cluster.comm_on(cand.path))


def schedule_of(cand: Candidate) -> Schedule:
    """The library schedule of ``cand``'s family on its path."""
    return _library_schedule(cand.family, len(cand.path), cand.m)


@lru_cache(maxsize=64)
def _library_schedule(family: str, p: int, m: int) -> Schedule:
    """Generators are pure, so one schedule serves every candidate of the same shape."""
    return build(family, p, m)


def simulate_candidate(model: Model, cluster: Cluster, cand: Candidate) -> Outcome | None:
    """Simulate ``cand``; None when its family cannot run it (e.g. too few micro-batches).
    Model, cluster and candidate are immutable and the simulation is pure, so an outcome is
    remembered: a plan meets the same candidate again (about 3 in 10 of its simulations of
    GPT-1.3B on 8 devices), in another layout's row or in the polish, and pays once. Budgets
    count the candidates tried, remembered or not, so a plan is the same either way. A model
    or cluster built with lists where tuples belong cannot be a key; it is simulated as is."""
    try:
        hash((model, cluster, cand))
    except TypeError:
        return _simulate(model, cluster, cand)
    return _remembered(model, cluster, cand)


@lru_cache(maxsize=4096)
def _remembered(model: Model, cluster: Cluster, cand: Candidate) -> Outcome | None:
    """``_simulate``, remembered (the last 4096 candidates)."""
    return _simulate(model, cluster, cand)


def _simulate(model: Model, cluster: Cluster, cand: Candidate) -> Outcome | None:
    """The simulation itself (``simulate_candidate``)."""
    cost = cost_model(model, cluster, cand)
    try:
        schedule = schedule_of(cand)
        metrics = simulate(schedule, cost).metrics()
    except FlexPipeError:
        return None
    fits = all(peak <= cluster.devices[d].memory * (1 + 1e-9)
               for peak, d in zip(metrics.peak_memory, cand.path, strict=True))
    return Outcome(cand, metrics.makespan, metrics.peak_memory, fits, schedule, cost)


def can_fit(model: Model, cluster: Cluster, cand: Candidate) -> bool:
    """Necessary for any schedule: every device holds its parameters and, at some point, one
    micro-batch's activation of each of its stages (held from its first stage's F to its B)."""
    return _fits(model, cluster, cand, lambda rank, p: 1)


def likely_fits(model: Model, cluster: Cluster, cand: Candidate) -> bool:
    """Whether every device holds its parameters plus the activations of the micro-batches 1F1B
    keeps in flight on it (``min(p - rank, m)`` of each of its stages): a guess for ordering."""
    return _fits(model, cluster, cand, lambda rank, p: min(p - rank, cand.m))


def _fits(model: Model, cluster: Cluster, cand: Candidate,
          held: Callable[[int, int], int]) -> bool:
    devs = cand.stage_devices()
    ranks = cand.placement.stage_rank
    p = len(cand.path)
    need = [0.0] * p
    for s, _dev in enumerate(devs):
        layers = model.layers[cand.cuts[s]:cand.cuts[s + 1]]
        need[ranks[s]] += (sum(x.params for x in layers)
                           + held(ranks[s], p) * cand.b * sum(x.act for x in layers))
    return all(need[r] <= cluster.devices[d].memory for r, d in enumerate(cand.path))


def estimate(model: Model, cluster: Cluster, cand: Candidate) -> tuple[float, float]:
    """(estimate, lower bound) of the iteration time. The estimate is the classic pipeline
    formula: (m - 1) x the slowest device or link round trip + one micro-batch's way through.
    The bound holds for every schedule: a device runs its compute one op at a time, cannot start
    before the first micro-batch reaches it, and after its last backward the gradient still has
    to travel back through every earlier stage (see docs/plan.md)."""
    devs = cand.stage_devices()
    ranks = cand.placement.stage_rank
    p = len(cand.path)
    work, fb, head = [0.0] * p, [0.0] * p, [-1.0] * p
    back = [0.0] * len(devs)  # B time of stages before s plus the links back to them
    arrive = total = slow_link = 0.0
    for s, dev in enumerate(devs):
        layers = model.layers[cand.cuts[s]:cand.cuts[s + 1]]
        k = cand.b / cluster.devices[dev].speed
        f, b = k * sum(x.f for x in layers), k * sum(x.b for x in layers)
        t = k * sum(x.work for x in layers)
        work[ranks[s]] += t
        fb[ranks[s]] += f + b
        if head[ranks[s]] < 0:
            head[ranks[s]] = arrive
        total += t
        if s + 1 < len(devs):
            nbytes = cand.b * layers[-1].out_bytes
            go = cluster.time(dev, devs[s + 1], nbytes)
            ret = cluster.time(devs[s + 1], dev, nbytes)
            arrive += f + go
            back[s + 1] = back[s] + b + ret
            total += go + ret
            slow_link = max(slow_link, go + ret)
    est = (cand.m - 1) * max(max(work), slow_link) + total
    tails = [0.0] * p
    if is_linear(cand.family):
        tails = [back[r] for r in range(p)]
    bound = max(head[r] + max(cand.m * work[r], cand.m * fb[r] + tails[r]) for r in range(p))
    return max(est, bound), bound


def iteration_bound(model: Model, cluster: Cluster) -> float:
    """No plan of whole layers is faster: for every weight w, some device runs at least
    ceil(c / n) of the c layers weighing at least w (pigeonhole), so it spends the sum of the
    lightest of them on each of the global batch's samples, at best at the fastest speed."""
    works = sorted(x.work for x in model.layers)
    n, speed = cluster.size, max(d.speed for d in cluster.devices)
    best = 0.0
    for j in range(len(works)):
        heavy = works[j:]
        k = -(-len(heavy) // n)
        best = max(best, sum(heavy[:k]))
    return model.global_batch * best / speed
