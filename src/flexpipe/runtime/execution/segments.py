"""Models that are graphs of layer sequences, cut into stages.

A model is a list of ``Segment``s in dependency order: a segment is a sequence of layers (a
tower, a branch, a head) fed either by the batch inputs (a source: ``feeds`` picks which) or by
the outputs of earlier segments (``after``, in the order its first layer takes them). A
partition gives layers per stage, segment after segment; stages are numbered in that order, a
segment's stages form a chain, and the first stage of a segment with ``after`` has one edge from
the last stage of each segment it follows. The result is a ``StageGraph`` and the stage modules.
A chain model is the one-segment case (``build_stages``).

``run_graph`` runs the stages of a graph in topological order on one device (the
single-process reference, ``forward_graph``, and the profiler's stage inputs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.ir.graph import StageGraph
from flexpipe.runtime.execution.stage import Route, StageModule, Tensors, Tie, even_partition


@dataclass(frozen=True, eq=False)
class Segment:
    """A run of consecutive layers of a model graph."""

    name: str
    """Start of its parameter names (``image`` gives ``image.3.lin.weight``); "" for a chain."""
    layers: tuple[nn.Module, ...]
    """Its layers, in order."""
    after: tuple[str, ...] = ()
    """Segments whose outputs feed it, in the order its first layer takes them; () for a
    source segment, which reads the batch inputs."""
    feeds: tuple[int, ...] | None = None
    """On a source segment: which batch inputs it reads (None: all, in order)."""
    takes: tuple[tuple[int, ...], ...] | None = None
    """Per segment of ``after``: the indices of its outputs this one reads, in order (None:
    all of every one's). A skip edge then carries only what its consumer uses."""
    grads: tuple[bool, ...] | None = None
    """Per value it reads (in order): whether its gradient flows back (None: every float
    value's). A value that depends on no parameter (a mask, rotary tables) needs none."""


@dataclass(frozen=True)
class StagePlan:
    """Per stage: (segment index, first layer in the segment, layer count); and the graph."""

    parts: tuple[tuple[int, int, int], ...]
    graph: StageGraph


def check_segments(segments: Sequence[Segment]) -> None:
    """Names unique, every segment has layers, ``after`` names only earlier segments."""
    if not segments:
        raise ConfigError("a model needs at least one segment of layers")
    seen: set[str] = set()
    for seg in segments:
        if seg.name in seen:
            raise ConfigError(f"segment name {seg.name!r} is used twice")
        if not seg.layers:
            raise ConfigError(f"segment {seg.name!r} has no layers")
        unknown = [a for a in seg.after if a not in seen]
        if unknown:
            raise ConfigError(f"segment {seg.name!r} follows {unknown}, which are not earlier "
                              f"segments (list segments in dependency order)")
        if seg.takes is not None and len(seg.takes) != len(seg.after):
            raise ConfigError(f"segment {seg.name!r} says what it takes from "
                              f"{len(seg.takes)} segments but follows {len(seg.after)}")
        taken = None if seg.takes is None else sum(map(len, seg.takes))
        if seg.grads is not None and len(seg.grads) != taken:
            raise ConfigError(f"segment {seg.name!r} gives {len(seg.grads)} gradient flags "
                              f"for {taken or 'no picked'} values (flags need ``takes``)")
        if seg.after and seg.feeds is not None:
            raise ConfigError(f"segment {seg.name!r} follows other segments and cannot also "
                              "read batch inputs (feeds)")
        seen.add(seg.name)


def stage_counts(sizes: Sequence[int], num_stages: int) -> list[int]:
    """Stages per segment when no partition is given: one each, then each extra stage to the
    segment with the most layers per stage (the earliest on ties)."""
    if num_stages < len(sizes):
        raise ConfigError(f"the model has {len(sizes)} segments, more than the {num_stages} "
                          "stages of the schedule")
    counts = [1] * len(sizes)
    for _ in range(num_stages - len(sizes)):
        best = max(range(len(sizes)), key=lambda i: (sizes[i] / counts[i], -i))
        counts[best] += 1
    return counts


def _split(partition: Sequence[int], sizes: Sequence[int], num_stages: int) -> list[list[int]]:
    """The flat partition (layers per stage) cut at the segment boundaries."""
    parts = list(partition)
    if len(parts) != num_stages or any(n < 1 for n in parts) or sum(parts) != sum(sizes):
        raise ConfigError(f"partition {parts} must give each of the {num_stages} stages at least "
                          f"one layer and cover all {sum(sizes)} layers")
    out: list[list[int]] = []
    for size in sizes:
        mine: list[int] = []
        while parts and sum(mine) < size:
            mine.append(parts.pop(0))
        if sum(mine) != size:
            raise ConfigError(f"partition {list(partition)} does not cut at the segment "
                              f"boundaries (segments of {list(sizes)} layers)")
        out.append(mine)
    return out


def plan_stages(segments: Sequence[Segment], partition: Sequence[int] | None,
                num_stages: int) -> StagePlan:
    """Cut ``segments`` into ``num_stages`` stages (``partition``: layers per stage, segment
    after segment; None: ``stage_counts`` stages per segment, layers as even as possible)."""
    check_segments(segments)
    sizes = [len(seg.layers) for seg in segments]
    per_seg = (_split(partition, sizes, num_stages) if partition is not None else
               [even_partition(n, c) for n, c in zip(sizes, stage_counts(sizes, num_stages),
                                                      strict=True)])
    parts: list[tuple[int, int, int]] = []
    last: dict[str, int] = {}
    edges: list[tuple[int, int]] = []
    for k, (seg, counts) in enumerate(zip(segments, per_seg, strict=True)):
        edges += [(last[a], len(parts)) for a in seg.after]
        for i, count in enumerate(counts):
            if i:
                edges.append((len(parts) - 1, len(parts)))
            parts.append((k, sum(counts[:i]), count))
        last[seg.name] = len(parts) - 1
    return StagePlan(tuple(parts), StageGraph(len(parts), tuple(edges)))


def build_graph_stages(segments: Sequence[Segment], partition: Sequence[int] | None,
                       num_stages: int, keep: Sequence[int] | None = None,
                       graph: StageGraph | None = None) -> dict[int, StageModule]:
    """Stage modules (only those in ``keep``, default all) of ``plan_stages``; with ``graph``
    (a schedule's), first check that the model's stage graph is that graph."""
    plan = plan_stages(segments, partition, num_stages)
    if graph is not None:
        check_graph(plan.graph, graph)
    ties = find_ties(segments, plan)
    wanted = range(num_stages) if keep is None else keep
    routes = _routes(segments, plan)
    out: dict[int, StageModule] = {}
    for s in wanted:
        k, first, count = plan.parts[s]
        seg = segments[k]
        feeds = seg.feeds if first == 0 else None
        out[s] = StageModule(seg.layers[first:first + count], first,
                             f"{seg.name}." if seg.name else "", feeds, ties)
        out[s].routes = {c: r for (p, c), r in routes.items() if p == s}
        out[s].grad_inputs = seg.grads if first == 0 else None
    return out


def _routes(segments: Sequence[Segment], plan: StagePlan) -> dict[tuple[int, int], Route]:
    """(producer stage, consumer stage) -> what the consumer reads, for every edge into a
    segment that says what it takes (``Segment.takes``)."""
    first = {segments[k].name: s for s, (k, start, _) in enumerate(plan.parts) if start == 0}
    last = {segments[k].name: s for s, (k, _, _) in enumerate(plan.parts)}
    out: dict[tuple[int, int], Route] = {}
    for seg in segments:
        if seg.takes is None:
            continue
        flags = iter(seg.grads) if seg.grads is not None else None
        for name, picks in zip(seg.after, seg.takes, strict=True):
            out[(last[name], first[seg.name])] = tuple(
                (i, next(flags) if flags is not None else True) for i in picks)
    return out


def find_ties(segments: Sequence[Segment], plan: StagePlan) -> tuple[Tie, ...]:
    """Every parameter object that two or more stages of ``plan`` use."""
    found: dict[int, list[tuple[int, str, str]]] = {}
    for s, (k, first, count) in enumerate(plan.parts):
        seg = segments[k]
        for i, layer in enumerate(seg.layers[first:first + count]):
            for name, p in layer.named_parameters(remove_duplicate=False):
                where = f"{seg.name + '.' if seg.name else ''}{first + i}.{name}"
                uses = found.setdefault(id(p), [])
                if all(u[0] != s for u in uses):
                    uses.append((s, f"layers.{i}.{name}", where))
    return tuple(Tie(uses[0][2], tuple((s, local) for s, local, _ in uses))
                 for uses in found.values() if len(uses) > 1)


def check_graph(model: StageGraph, schedule: StageGraph) -> None:
    """The schedule's stage graph must be the model's: same stages, same producers of every
    stage in the same order (the order in which a stage takes its inputs)."""
    if model.num_stages != schedule.num_stages:
        raise ConfigError(f"the model is cut into {model.num_stages} stages, the schedule has "
                          f"{schedule.num_stages}")
    for s in range(model.num_stages):
        if model.preds[s] != schedule.preds[s]:
            want = " ".join(f"{a}>{b}" for a, b in model.edges)
            raise ConfigError(
                f"stage {s} takes its inputs from stages {list(model.preds[s])} in the model, "
                f"from {list(schedule.preds[s])} in the schedule's graph; the model's graph is "
                f"'edges: {want}'")


def run_graph(stages: Mapping[int, StageModule], graph: StageGraph,
              inputs: Sequence[torch.Tensor]) -> tuple[dict[int, Tensors], dict[int, Tensors]]:
    """Run every stage once on one device (in index order, which ``plan_stages`` makes
    topological): the inputs and the outputs of every stage."""
    ins: dict[int, Tensors] = {}
    outs: dict[int, Tensors] = {}
    for s in range(graph.num_stages):
        if any(p > s for p in graph.preds[s]):
            raise ConfigError(f"stage {s} follows a later stage; number stages in "
                              "topological order")
        ins[s] = stage_inputs(stages, graph, s, outs, inputs)
        outs[s] = tuple(stages[s](*ins[s]))
    return ins, outs


def stage_inputs(stages: Mapping[int, StageModule], graph: StageGraph, s: int,
                 outs: Mapping[int, Tensors], inputs: Sequence[torch.Tensor]) -> Tensors:
    """What stage ``s`` takes, once its producers' ``outs`` are known: what it reads of each
    (``StageModule.handed``), or on a source stage its batch ``inputs``."""
    if not graph.preds[s]:
        return stages[s].pick_inputs(inputs)
    return tuple(t for p in graph.preds[s] for t in stages[p].handed(s, outs[p]))


def forward_graph(stages: Mapping[int, StageModule], graph: StageGraph,
                  inputs: Sequence[torch.Tensor]) -> dict[int, Tensors]:
    """The outputs of the sink stages of one forward on one device (the reference)."""
    outs = run_graph(stages, graph, inputs)[1]
    return {s: outs[s] for s in graph.sinks()}


def build_stages(layers: Sequence[nn.Module], partition: Sequence[int] | None,
                 num_stages: int, keep: Sequence[int] | None = None) -> dict[int, StageModule]:
    """Stage modules (only the stages in ``keep``, default all) for a partition given as
    layers per stage (None: even): the one-segment case of ``build_graph_stages``."""
    return build_graph_stages([Segment("", tuple(layers))], partition, num_stages, keep)
