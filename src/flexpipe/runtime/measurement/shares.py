"""W's deferred share of each stage of a model graph: the fraction of a stage's trainable weight
elements whose gradient W computes (the rest B computes with the input gradient), from one
recorded forward of one micro-batch through every stage in turn, each fed what it reads of
its producers (``StageModule.handed``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexpipe.runtime.execution.segments import (
    Segment,
    build_graph_stages,
    plan_stages,
    stage_inputs,
)
from flexpipe.runtime.execution.stage import Tensors
from flexpipe.runtime.split import WeightWork, recorded_share, recording


def deferred_shares(segments: Sequence[Segment], inputs: Sequence[torch.Tensor],
                    num_stages: int, device: str | torch.device = "cpu") -> list[float]:
    """The share of every stage of ``segments`` cut into ``num_stages`` (even partition), on
    ``inputs`` (one micro-batch's batch inputs)."""
    stages = build_graph_stages(segments, None, num_stages)
    graph = plan_stages(segments, None, num_stages).graph
    outs: dict[int, Tensors] = {}
    shares = []
    for k in range(num_stages):
        stage = stages[k]
        stage.to(device)
        flat = tuple(t.to(device) for t in stage_inputs(stages, graph, k, outs, inputs))
        work = WeightWork()
        with recording(work):
            outs[k] = stage(*stage.leaves(flat, source=not graph.preds[k]))
        shares.append(recorded_share(stage, work))
    return shares
