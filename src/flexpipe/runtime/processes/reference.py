"""The single-device reference every exactness check compares a pipeline with: the whole model
trained on one process on the same data (every replica's micro-batches, each micro-batch's
random draws keyed as the ranks key them), its losses per step, first-step gradients and
final parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexpipe.runtime.execution.fsdp import full_named
from flexpipe.runtime.execution.rng import Draw, drawing
from flexpipe.runtime.execution.segments import build_graph_stages, forward_graph, plan_stages
from flexpipe.runtime.models.kinds import make_batch, model_segments
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.train import TrainConfig, make_optimizer


@dataclass
class Reference:
    """The single-device run: losses per step, first-step gradients, final parameters."""

    losses: list[float]
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]


def reference_run(model: ModelSpec, train: TrainConfig, microbatches: int) -> Reference:
    """Train the whole model on one device on the same data (all replicas' micro-batches);
    a graph model runs segment by segment (one stage each). A loss with a ``joint(outs,
    target)`` (a vocabulary-parallel one, whose per-sink form is a collective) takes every
    sink's outputs at once instead of being summed over the sinks."""
    segments, loss_fn = model_segments(model)
    sizes = [len(seg.layers) for seg in segments]
    graph = plan_stages(segments, sizes, len(sizes)).graph
    whole = build_graph_stages(segments, sizes, len(sizes))
    opt = make_optimizer([p for s in whole.values() for p in s.parameters()], train)
    ref = Reference([], {}, {})
    count = microbatches * train.replicas
    for step in range(train.steps):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for replica in range(train.replicas):
            batch = make_batch(model, step, microbatches, replica, train.replicas)
            for mb, (inputs, target) in enumerate(batch):
                draw = None if train.seed is None else \
                    Draw(train.seed, step, replica * microbatches + mb)
                with drawing(draw):
                    outs = forward_graph(whole, graph, inputs).values()
                joint = getattr(loss_fn, "joint", None)  # one loss over every sink at once
                loss = (joint(list(outs), target) if joint is not None else
                        torch.stack([loss_fn(*out, target) for out in outs]).sum()) / count
                loss.backward()
                total += loss.item()
        if step == 0:
            ref.grads = full_named(whole, grads=True)
        opt.step()
        ref.losses.append(total)
    ref.params = full_named(whole, grads=False)
    return ref
