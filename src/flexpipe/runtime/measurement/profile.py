"""Profiling a model into a cost model the simulator reads: each stage's F, B, W, BW and SR
(selective recompute) times, its activation sizes, and the point-to-point latency and bandwidth
between ranks, all measured on the real model. Every rank profiles its own stages at the same
time (so the machine is as busy as in training), on the device it trains on (its GPU under
NCCL, where each time is read after the GPU has finished the work), on a CPU each pass also
with the caches evicted first, as it runs after another stage's pass (``caches``: the
``cold`` times, the ranks taking turns); the ranks then measure the compute thread's time
per send and receive under gloo (``posting``: the links' ``post``) and time ping-pongs pair
by pair.
Times are in ms, sizes in bytes (``flexpipe.cost.io.save_cost`` writes the result as JSON).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexpipe.cost.model import CONTEXTS, Comm, CostModel, Edge, StageCost
from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.runtime.execution.segments import build_graph_stages, plan_stages, run_graph
from flexpipe.runtime.execution.selective import Selective
from flexpipe.runtime.execution.stage import StageModule, Tensors
from flexpipe.runtime.measurement.caches import evictor
from flexpipe.runtime.measurement.measure import median
from flexpipe.runtime.measurement.post_cost import post_time
from flexpipe.runtime.measurement.sizes import (
    backward_pass,
    forward_pass,
    in_edges,
    loss_on,
    nbytes,
    stage_memory,
)
from flexpipe.runtime.models.kinds import make_batch, model_segments
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.split import WeightWork, recording
from flexpipe.runtime.transport import comm

REPS = 5
"""Timed rounds of each pass, by default (``profile``, ``profile_together``, ``time_stages``)."""
SMALL, LARGE = 1 << 10, 1 << 22  # ping-pong sizes in bytes
BARRIER_S = 600.0  # how long ranks wait for each other between measurements (s)
WARM_UP = 2
"""Untimed rounds before the hot rounds are timed (the allocator and the kernels warmed)."""
AFTER_W, FUSED = "after_w:F", "fused:F"  # a round's keys of F in those contexts (StageCost)


def clock(device: torch.device) -> Callable[[], float]:
    """Seconds, read once ``device`` has finished what was queued on it (a GPU computes
    asynchronously: without this, a time is only how long the launches took)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return synced


Timed = tuple[StageModule, Tensors, Callable[[Tensors], torch.Tensor] | None, bool]
"""A stage to time: (stage, its inputs, its loss on a sink else None, whether it is a source)."""


def _round(item: Timed, now: Callable[[], float],
           evict: Callable[[], None] | None = None) -> dict[str, float]:
    """One micro-batch through ``item``: F, B and W split, then F and a fused BW; ms. Hot
    (no ``evict``), also the forward in two more contexts (``StageCost``): split again right
    after its stage's W (``AFTER_W``), and of a micro-batch whose backward is fused, after a BW
    (``FUSED``: it records nothing for W), the BW timed after it. With ``evict``, each timed
    pass starts with the caches evicted (a cold pass: ``caches``).
    The weight gradients are kept between rounds (zeroed, not dropped), so W and BW add into
    them as they do in a training step (``opt.zero_grad(set_to_none=False)``): an
    accumulation into an existing gradient reads and writes every weight's worth of memory,
    which a W into no gradient (it takes the product as the gradient) does not."""
    stage, xs, loss, source = item
    params: list[torch.Tensor] = [p for p in stage.parameters() if p.requires_grad]
    times: dict[str, float] = {}

    def timed(key: str | None, run: Callable[[], Any]) -> Any:
        if key is None:  # untimed: a pass that only sets up the next one's context
            return run()
        if evict is not None:
            evict()
        t0 = now()
        out = run()
        times[key] = (now() - t0) * 1e3
        return out

    def split(f_key: str, rest: bool) -> None:
        inputs, work = stage.leaves(xs, source), WeightWork()
        with recording(work):
            outs = timed(f_key, lambda: forward_pass(stage, inputs, loss))
        with work.backward_input():
            timed("B" if rest else None, lambda: backward_pass(outs, inputs, params))
        timed("W" if rest else None, work.run)

    def fused(f_key: str | None, bw: bool) -> None:
        inputs = stage.leaves(xs, source)
        outs = timed(f_key, lambda: forward_pass(stage, inputs, loss))
        timed("BW" if bw else None, lambda: backward_pass(outs, inputs, params))

    hot = evict is None
    split("F", True)
    if hot:
        split(AFTER_W, False)
    fused(None, not hot)
    if hot:
        fused(FUSED, True)  # F and BW after a BW, as a fused schedule runs them
    stage.zero_grad(set_to_none=False)
    return times


def time_stages(items: Sequence[Timed], reps: int = REPS,
                together: bool = False) -> list[dict[str, Any]]:
    """``time_stage`` for all the stages of one rank, taken in turn round after round. Each
    stage's hot round runs its passes one after another, as a pass that follows its own
    stage's runs in training (after an untimed forward of that stage where the rank has
    others, so its F too follows its own stage); then, on a CPU, cold rounds evict the caches
    before each pass (the ``cold`` times, for a pass that follows another stage's:
    ``caches``; ``_cold_rounds``). ``together``: every rank of the process group is timing its
    own stages, and this one keeps computing until all have finished (``_stay_busy``)."""
    hot = _timed_rounds(items, reps, None)
    if together:
        _stay_busy(items)
    cold = _cold_rounds(items, reps, together)
    for stage, *_ in items:
        stage.zero_grad(set_to_none=True)  # the profile leaves no gradients behind
    return [_medians(warm, evicted) | {"SR": _time_sr(stage, xs, loss, source, reps)}
            | stage_memory(stage, xs, loss, source)
            for (stage, xs, loss, source), warm, evicted in zip(items, hot, cold, strict=True)]


def _medians(warm: dict[str, list[float]], evicted: dict[str, list[float]]) -> dict[str, Any]:
    """A stage's median times: the plain ones by key, and a table per context (``cold`` from
    the evicted rounds, the others from the hot rounds' ``context:key`` times)."""
    out: dict[str, Any] = {"cold": {k: median(v) for k, v in evicted.items()}}
    for key, values in warm.items():
        context, _, kind = key.rpartition(":")
        (out.setdefault(context, {}) if context else out)[kind] = median(values)
    return out


def _timed_rounds(items: Sequence[Timed], reps: int,
                  evict: Callable[[], None] | None) -> list[dict[str, list[float]]]:
    """``reps`` rounds of every item in turn, each pass's times: hot (no ``evict``) after
    ``WARM_UP`` untimed rounds; with ``evict`` every timed pass starts with the caches evicted,
    and there is nothing to warm (the hot rounds ran just before, and an eviction costs a
    write of twice the largest cache: 0.1 s here)."""
    got: list[dict[str, list[float]]] = [{} for _ in items]
    warm_up = WARM_UP if evict is None else 0
    for rep in range(reps + warm_up):
        for item, acc in zip(items, got, strict=True):
            if evict is None and len(items) > 1:
                _pass(item)()  # the hot F follows its own stage, not the previous item's
            _note(acc, _round(item, clock(item[1][0].device), evict), rep >= warm_up)
    return got


def _cold_rounds(items: Sequence[Timed], reps: int,
                 together: bool) -> list[dict[str, list[float]]]:
    """On a CPU, every pass timed again with the caches evicted first (``caches``); nothing
    on other devices. ``together``: the ranks take turns, the others running their passes
    untimed meanwhile (``_stay_busy``), as they compute in training. An eviction writes
    twice the shared last-level cache: beside another rank's timed passes it slowed them
    (Hugging Face GPT-2 at hidden 256: 1F1B's BW profiled 1.05x what it trained at with the
    ranks evicting at once, 1.01x with the cold rounds taken apart)."""
    evict = evictor(items[0][1][0].device) if items else None
    cold: list[dict[str, list[float]]] = [{} for _ in items]
    active = evict is not None and evict.active
    for turn in range(comm.world_size() if together else 1):
        if active and (not together or turn == comm.my_rank()):
            cold = _timed_rounds(items, reps, evict)
        if together:
            _stay_busy(items)
    return cold


def _note(acc: dict[str, list[float]], got: dict[str, float], keep: bool) -> None:
    """Keep a round's times (not a warm-up round's: ``keep`` False)."""
    if keep:
        for key, ms in got.items():
            acc.setdefault(key, []).append(ms)


def _stay_busy(items: Sequence[Timed]) -> None:
    """Run untimed rounds of ``items`` until every rank has timed its stages. Under gloo the
    ranks share the host's cores, caches and memory bandwidth, and a pass runs slower while
    another rank computes (on 2 ranks of the 2-core development machine a profiling round
    ran 1.01-1.5x slower with the other rank computing than alone); in a pipeline the ranks
    compute at the same time, so a rank that finished first must not leave the others' last
    repetitions to run alone, faster than they train. GPUs do not share that way: under NCCL
    a rank stops at once."""
    if comm.is_nccl() or comm.world_size() < 2:
        return
    done, deadline = comm.post_done(), time.monotonic() + BARRIER_S
    while not comm.all_done(done):
        if time.monotonic() > deadline:
            raise comm.PeerError(f"rank {comm.my_rank()}: the other ranks did not finish "
                                 f"profiling within {BARRIER_S:.0f}s")
        for item in items:
            _round(item, clock(item[1][0].device))
        if not items:  # nothing to compute: every rank still posts its part of the signal
            time.sleep(0.001)


def time_stage(stage: StageModule, xs: Tensors, loss: Callable[[Tensors], torch.Tensor] | None,
               source: bool, reps: int = REPS) -> dict[str, Any]:
    """Median F, B, W, BW times (ms) of one micro-batch, and the stage's memory sizes. F, B
    and W are the split the executor runs (``flexpipe.runtime.split``); BW a fused
    backward."""
    return time_stages([(stage, xs, loss, source)], reps)[0]


def _time_sr(stage: StageModule, xs: Tensors, loss: Callable[[Tensors], torch.Tensor] | None,
             source: bool, reps: int) -> float:
    """Median time (ms) of selective recompute (SR) of one micro-batch: redoing the attention
    cores a forward dropped (0 when the stage has none)."""
    now = clock(xs[0].device)
    out = []
    for _ in range(reps + 1):
        record = Selective("profile")
        with record.active(stage):
            forward_pass(stage, stage.leaves(xs, source), loss)
        t0 = now()
        record.recompute()
        out.append((now() - t0) * 1e3)
    return median(out[1:])


def _ping_pong(peer: int, nbytes: int, first: bool, reps: int = 9) -> float:
    """Median one-way time (ms) of ``nbytes`` between this rank and ``peer``, in this rank's
    memory (a GPU's under NCCL: the path activations take)."""
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=comm.device())
    now = clock(buf.device)
    out = []
    for _ in range(reps + 1):
        t0 = now()
        comm.ping_pong(buf, peer, first)
        out.append((now() - t0) * 1e3 / 2)
    return median(out[1:])


def _links(rank: int, world: int) -> dict[tuple[int, int], tuple[float, float]]:
    """(latency ms, bandwidth bytes/ms) of every pair of ranks, measured pair by pair."""
    links = {}
    for a in range(world):
        for b in range(a + 1, world):
            if rank in (a, b):
                small = _ping_pong(b if rank == a else a, SMALL, rank == a)
                large = _ping_pong(b if rank == a else a, LARGE, rank == a)
                bw = LARGE / max(large - small, large / 2)  # noise-robust
                links[(a, b)] = (small, bw)
            comm.barrier(BARRIER_S)
    return links


Profiled = tuple[ModelSpec, Placement, Sequence[int] | None]
"""A model, the placement its stages take and its partition (None: the model's own split)."""


def _stages_of(job: Profiled, rank: int, device: torch.device
               ) -> tuple[list[Timed], list[int], Any]:
    """This rank's stages of ``job`` ready to time, their indices, and what their edges need
    (stages, graph, outputs)."""
    model, placement, partition = job
    segments, loss_fn = model_segments(model)
    stages = {s: m.to(device) for s, m in build_graph_stages(segments, partition,
                                                              placement.num_stages).items()}
    graph = plan_stages(segments, partition, placement.num_stages).graph
    (inputs, target), = make_batch(model, 0, 1)
    inputs, target = tuple(t.to(device) for t in inputs), target.to(device)
    with torch.no_grad():
        xs, outs = run_graph(stages, graph, inputs)
    mine = list(placement.rank_stages[rank])
    items: list[Timed] = [(stages[s], xs[s], loss_on(loss_fn, target) if s in graph.sinks()
                           else None, s in graph.sources()) for s in mine]
    return items, mine, (stages, graph, outs)


def profile_task(rank: int, world: int, jobs: Sequence[Profiled],
                 reps: int) -> list[dict[str, Any]]:
    """Launch task: time this rank's stages of every job together, round by round (so jobs
    compared with each other see the machine in the same state), then the links once (see
    the module docstring); one result per job."""
    device = comm.device()
    built = [_stages_of(job, rank, device) for job in jobs]
    comm.barrier(BARRIER_S)  # every rank starts timing at once, as its stages run in training
    timed = iter(time_stages([item for items, _, _ in built for item in items], reps,
                             together=True))
    results = []
    for _, mine, (stages, graph, outs) in built:
        costs = {s: next(timed) for s in mine}
        edges = {(p, c): edge for c in mine
                 for p, edge in in_edges(stages, graph, c, outs, costs[c]).items()}
        results.append({"stages": costs, "edges": edges})
    comm.barrier(BARRIER_S)
    every = [item for items, _, _ in built for item in items]
    post = post_time([_pass(item) for item in every], _boundary(every), BARRIER_S)
    links = _links(rank, world)
    return [res | {"links": links, "post": post} for res in results]


def _pass(item: Timed) -> Callable[[], None]:
    """One forward pass of ``item`` as training runs it (its outputs dropped)."""
    stage, xs, loss, source = item

    def run() -> None:
        forward_pass(stage, stage.leaves(xs, source), loss)
    return run


def _boundary(items: Sequence[Timed]) -> int:
    """Bytes of the largest stage input among ``items``: a message's size."""
    return int(max((nbytes(xs) for _, xs, _, _ in items), default=0))


def to_cost_model(results: Sequence[dict[str, Any]], num_stages: int) -> CostModel:
    """Assemble the ranks' measurements into a ``CostModel``."""
    stages: dict[int, dict[str, Any]] = {}
    links: dict[tuple[int, int], tuple[float, float]] = {}
    edges: dict[tuple[int, int], tuple[float, float]] = {}
    post = statistics.fmean(res.get("post", 0.0) for res in results) if results else 0.0
    for res in results:
        stages |= res["stages"]
        links |= res["links"]
        edges |= res.get("edges", {})
    n = len(results)
    lat = [[0.0] * n for _ in range(n)]
    bw = [[math.inf] * n for _ in range(n)]
    for (a, b), (la, band) in links.items():
        lat[a][b] = lat[b][a] = la
        bw[a][b] = bw[b][a] = band
    costs = tuple(StageCost({k: stages[s][k] for k in ("F", "B", "W", "BW", "SR")
                             if k in stages[s]},
                            **{k: stages[s][k] for k in ("act", "wact", "input", "params",
                                                         "out_bytes")},
                            sr_act=stages[s].get("sr_act"), sr_act_w=stages[s].get("sr_act_w"),
                            **{t: stages[s].get(t, {}) for t in CONTEXTS})
                  for s in range(num_stages))
    return CostModel(costs, Comm(tuple(map(tuple, lat)), tuple(map(tuple, bw)), post),
                     tuple(Edge(p, c, *sent) for (p, c), sent in sorted(edges.items())))


def profile(model: ModelSpec, placement: Placement, partition: Sequence[int] | None = None,
            reps: int = REPS, threads: int = 1, timeout_s: float = 120.0) -> CostModel:
    """Profile ``model`` split into ``placement``'s stages on as many local processes as the
    placement has ranks; the measured cost model."""
    return profile_together([(model, placement, partition)], reps, threads, timeout_s)[0]


def profile_together(jobs: Sequence[Profiled], reps: int = REPS, threads: int = 1,
                     timeout_s: float = 120.0) -> list[CostModel]:
    """Profile several (model, placement, partition) in one launch, their stages timed in turn
    round after round, so that their predictions can be ranked against each other (profiled
    apart, a machine whose speed drifts between the launches ranks them by the drift); one
    cost model per job. Every placement must have the same number of ranks."""
    from flexpipe.runtime.processes.launch import launch_task

    ranks = {placement.num_ranks for _, placement, _ in jobs}
    if len(ranks) != 1:
        raise ConfigError(f"profiling together needs one rank count, the placements have "
                          f"{sorted(ranks)}")
    per_rank = launch_task(profile_task, (list(jobs), reps), ranks.pop(), threads=threads,
                           timeout_s=timeout_s * len(jobs))
    return [to_cost_model([r[i] for r in per_rank], placement.num_stages)
            for i, (_, placement, _) in enumerate(jobs)]
