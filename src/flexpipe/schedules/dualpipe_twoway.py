"""DualPipe, the two-way schedule: micro-batches fed from both ends of the pipeline at once,
each rank holding one stage of each direction, a forward of one direction overlapped with a
backward of the other in the steady phase (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024,
section 3.2.1, figure 5 and table 2).

With P ranks (P even) the model is cut into P stages; the *down* pipeline runs them on ranks
0, 1, ..., P-1 and the *up* pipeline on ranks P-1, ..., 0, so rank r holds model stage r of the
way down and model stage P-1-r of the way up: every model stage lives on two ranks, the 2x
parameter memory of DeepSeek's table (the two copies' gradients are summed after the step).

In the IR this is a stage graph of two chains, ``0 > 1 > ... > P-1`` (down) and
``P > P+1 > ... > 2P-1`` (up, stage P+k is model stage k), placed as a V: stage s on rank s
for s < P and on rank 2P-1-s above. Micro-batch j of the schedule is micro-batch j of each
direction, so ``m`` counts the micro-batches per direction (2m in all) and DeepSeek's
requirement of at least 2P micro-batches in all is m >= P.

Each rank runs DualPipeV's eight steps (``flexpipe.schedules.dualpipe``) as one rank of a
pipeline of P/2 ranks, r being its distance from the nearer end (min(r, P-1-r)), phase 0 the
direction that enters at that end: DeepSeek's own construction (its ranks of the second half
swap the two directions), which gives the bubble (P/2-1)(F&B + B - 3W) and P+1 chunks of
activations. Pure: no torch."""

from __future__ import annotations

from flexpipe.errors import InfeasibleError
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.placement import Placement
from flexpipe.ir.schedule import Schedule
from flexpipe.schedules.dualpipe import rank_order

TWO_WAY = "two-way"
"""The placement kind of DualPipe's two directions: its 2p stages are two copies of the model
cut one stage per rank, and its m counts micro-batches per direction."""


def two_way_graph(p: int) -> StageGraph:
    """The stage graph of DualPipe on p ranks: the down chain 0..p-1 and the up chain p..2p-1."""
    edges = [(s, s + 1) for s in range(p - 1)] + [(p + s, p + s + 1) for s in range(p - 1)]
    return StageGraph(2 * p, tuple(edges))


def two_way_placement(p: int) -> Placement:
    """Stage s of the down chain on rank s, stage p+k of the up chain on rank p-1-k."""
    stage_rank = tuple(range(p)) + tuple(range(p - 1, -1, -1))
    return Placement(stage_rank, p, TWO_WAY)


def model_stage(stage: int, p: int) -> int:
    """The model stage (0..p-1) that DualPipe's ``stage`` (0..2p-1) runs: s, or s - p up."""
    return stage if stage < p else stage - p


def dualpipe(p: int, m: int) -> Schedule:
    """DualPipe (DeepSeek-V3 report, sec. 3.2.1): p ranks (even), m micro-batches per
    direction (m >= p, so 2m >= 2p in all), each rank one stage of each direction; bubble
    (p/2 - 1)(F&B + B - 3W), 2x parameters, p + 1 chunks of activations (module docstring)."""
    if p % 2:
        raise InfeasibleError(f"dualpipe needs an even number of ranks, got p = {p}")
    if m < p:
        raise InfeasibleError(f"dualpipe needs at least p = {p} micro-batches per direction "
                              f"(2p = {2 * p} in all), got {m}")
    half = p // 2
    ranks = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        stages = (down, up) if r < half else (up, down)
        ranks.append(rank_order(stages, min(r, p - 1 - r), half, m))
    sched = Schedule.build([rank.ops for rank in ranks], two_way_placement(p), m,
                           graph=two_way_graph(p), name="dualpipe")
    return sched.with_overlaps(pair for rank in ranks for pair in rank.pairs)


def is_two_way(schedule: Schedule) -> bool:
    """Whether ``schedule`` is DualPipe's two-way placement (two directions, m per
    direction)."""
    return schedule.placement.kind == TWO_WAY


def model_stages(schedule: Schedule) -> int:
    """The stages the model is cut into: p for DualPipe (each one run by two of its 2p
    stages), else the schedule's stages."""
    return schedule.num_ranks if is_two_way(schedule) else schedule.num_stages


def data_microbatches(schedule: Schedule) -> int:
    """The micro-batches of data one step of ``schedule`` takes: 2m for DualPipe (m down,
    m up), else m."""
    return 2 * schedule.microbatches if is_two_way(schedule) else schedule.microbatches


def data_index(schedule: Schedule, stage: int, mb: int) -> int:
    """Which of the step's ``data_microbatches`` micro-batch ``mb`` of ``stage`` is: the down
    direction takes 0..m-1, the up direction (stages p..2p-1 of DualPipe) m..2m-1."""
    if is_two_way(schedule) and stage >= schedule.num_ranks:
        return schedule.microbatches + mb
    return mb


def model_placement(placement: Placement) -> Placement:
    """Where the model stages live, for cutting and profiling: DualPipe's p model stages one per
    rank (model stage k runs on rank k down and on rank p-1-k up, the two balanced alike),
    any other placement as it is."""
    if placement.kind != TWO_WAY:
        return placement
    return Placement(tuple(range(placement.num_ranks)), placement.num_ranks, "linear")
