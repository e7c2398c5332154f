"""Tessel's placement cases (Lin et al., HPCA 2024) as stage-graph models on p devices.

Every block takes 1 time unit forward and 3 backward (input and weight gradient fused: B = 3,
W = 0, and B frees the activation), holds 1 unit of activation; a *sharded* block spans every
device (a gang of p shard stages, 1 unit forward and backward, no activation), as a
tensor-parallel layer would. No communication time. Per micro-batch each device works 4 (v),
6 (m) or 8 (x, nn) units: the period of a zero-bubble repetend.

- ``tessel-v``: a chain over devices 0 .. p-1 (1F1B's shape).
- ``tessel-m``: a sharded block, then the chain over devices 0 .. p-1.
- ``tessel-x``: two chains per micro-batch, one over devices 0 .. p-1, one back over p-1 .. 0.
- ``tessel-nn``: a sharded block, devices 0 .. p/2-1, a sharded block, devices p/2 .. p-1.
"""

from __future__ import annotations

from collections.abc import Callable

from flexpipe.cost.model import Comm, CostModel, StageCost, merge_stages
from flexpipe.errors import ConfigError
from flexpipe.graphs.model import GraphModel
from flexpipe.ir.graph import StageGraph
from flexpipe.ir.placement import Placement

BLOCK = StageCost({"F": 1.0, "B": 3.0, "W": 0.0}, act=1.0, wact=0.0)
SHARD = StageCost({"F": 1.0, "B": 1.0, "W": 0.0}, act=0.0, wact=0.0)
LAYOUT = "tessel"
PERIOD = {"tessel-v": 4, "tessel-m": 6, "tessel-x": 8, "tessel-nn": 8}
"""Work per device and micro-batch: the repetend period without idle time."""

Piece = tuple[str, tuple[int, ...]]  # ("block", (device,)) or ("shard", all devices)


def _pieces(name: str, p: int) -> list[list[Piece]]:
    """The model's chains of pieces (one chain per independent path of a micro-batch)."""
    down: list[Piece] = [("block", (d,)) for d in range(p)]
    shard: Piece = ("shard", tuple(range(p)))
    half = p // 2
    table: dict[str, Callable[[], list[list[Piece]]]] = {
        "tessel-v": lambda: [down],
        "tessel-m": lambda: [[shard, *down]],
        "tessel-x": lambda: [down, down[::-1]],
        "tessel-nn": lambda: [[shard, *down[:half], shard, *down[half:]]],
    }
    return table[name]()


def tessel(name: str, p: int) -> GraphModel:
    """Tessel case ``name`` (``tessel-v``, ``-m``, ``-x``, ``-nn``) on p devices."""
    if name not in PERIOD:
        raise ConfigError(f"unknown Tessel case {name!r} (known: {', '.join(PERIOD)})")
    stages: list[StageCost] = []
    ranks: list[int] = []
    edges: list[tuple[int, int]] = []
    gangs: list[tuple[int, ...]] = []
    chain: list[StageCost] = []
    for pieces in _pieces(name, p):
        prev: tuple[int, ...] = ()
        for kind, devices in pieces:
            ids = tuple(range(len(stages), len(stages) + len(devices)))
            stages += [BLOCK if kind == "block" else SHARD] * len(devices)
            ranks += devices
            edges += [(a, b) for a in prev for b in ids]
            if len(ids) > 1:
                gangs.append(ids)
            chain.append(BLOCK if kind == "block" else merge_stages([SHARD] * len(devices)))
            prev = ids
    graph = StageGraph(len(stages), tuple(edges), tuple(gangs))
    return GraphModel(name, LAYOUT, graph, Placement(tuple(ranks), p),
                      CostModel(tuple(stages), Comm.uniform(p, 0.0)), tuple(chain))


def builder(name: str) -> Callable[[int, str], GraphModel]:
    """A preset builder ``(p, layout) -> GraphModel`` for Tessel case ``name``."""
    def build(p: int, layout: str) -> GraphModel:
        return tessel(name, p)

    return build
