"""Memory sizes of one micro-batch on a stage, measured from the live tensors (what
``flexpipe.runtime.measurement.profile`` puts into a cost model as M_B, M_W and the edges'
bytes), and the stage passes both measurements run: a forward (with its loss on a sink) and a
backward from ones."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flexpipe.ir.graph import StageGraph
from flexpipe.runtime.execution.activations import ActivationMeter
from flexpipe.runtime.execution.selective import Core, Selective
from flexpipe.runtime.execution.stage import LossFn, StageModule, Tensors
from flexpipe.runtime.split import WeightWork, recording


def nbytes(ts: Sequence[torch.Tensor]) -> float:
    """Bytes of the tensors ``ts``."""
    return float(sum(t.numel() * t.element_size() for t in ts))


def forward_pass(stage: StageModule, xs: Tensors,
                 loss: Callable[[Tensors], torch.Tensor] | None) -> Tensors:
    """One forward of a stage (and its loss on a sink)."""
    out = stage(*xs)
    return (loss(out),) if loss is not None else out


def backward_pass(outs: Tensors, inputs: Tensors, params: Sequence[torch.Tensor]) -> None:
    """One backward of a stage from ``outs`` (ones as output gradients; the loss on a sink)."""
    live = [t for t in outs if t.requires_grad]
    if live:
        torch.autograd.backward(live, [torch.ones_like(t) for t in live],
                                inputs=[x for x in inputs if x.requires_grad] + list(params))


def stage_memory(stage: StageModule, xs: Tensors,
                 loss: Callable[[Tensors], torch.Tensor] | None, source: bool) -> dict[str, Any]:
    """Bytes of one micro-batch, measured from the live tensors: held after F (``act``: what
    autograd saved and the outputs kept for B, parameters excluded, each buffer once), held
    after B until W (``wact``: what the weight layers keep for W), the stage input, the
    parameters, the output, and per input the bytes of it that the forward keeps
    (``kept_inputs``: 0 for a source stage's batch, which is data) and that W still holds
    after B (``kept_w_inputs``); held after a forward marked for selective recompute
    (``sr_act``: ``sr_memory``)."""
    params = [p for p in stage.parameters() if p.requires_grad]
    meter, work = ActivationMeter.of([stage]), WeightWork()
    inputs = stage.leaves(tuple(t.clone() for t in xs), source)  # its own buffers, as on a rank
    # the batch and the loss's target are data, not activations (as the executor counts)
    meter.data([*(inputs if source else ()), *([loss.target] if isinstance(loss, Loss) else [])])
    with recording(work), meter.saving():
        outs = forward_pass(stage, inputs, loss)
    meter.record(*outs, *work.kept)
    act = meter.live()
    kept = [0.0 if source else float(t.nbytes) * meter.holds(t) for t in inputs]
    sizes, held = [0.0 if source else float(t.nbytes) for t in inputs], meter.holder(inputs)
    out_bytes = 0.0 if loss is not None else nbytes(outs)
    with work.backward_input():
        backward_pass(outs, inputs, params)
    del outs, inputs
    meter.record(*work.held)
    wact = meter.live()
    kept_w = [size * still for size, still in zip(sizes, held(), strict=True)]
    work.run()
    stage.zero_grad(set_to_none=True)
    return {"act": act, "wact": wact, "input": nbytes(xs),
            "params": nbytes(list(stage.parameters())), "out_bytes": out_bytes,
            "kept_inputs": kept, "kept_w_inputs": kept_w,
            "sr_act": sr_memory(stage, xs, loss, source, False),
            "sr_act_w": sr_memory(stage, xs, loss, source, True)}


def sr_memory(stage: StageModule, xs: Tensors, loss: Callable[[Tensors], torch.Tensor] | None,
              source: bool, split: bool) -> float | None:
    """Bytes of one micro-batch held after a forward marked for selective recompute, counted
    as ``stage_memory`` counts ``act``: what the stage's regions (``Core``) keep under the
    model's ``Recompute`` policy (their inputs, the outputs of the operations a per-op policy
    saves) and everything outside them; SR drops the rest. ``split``: the forward records
    for W (a split backward), whose records of the weight layers in a region SR keeps. None:
    the stage has no region."""
    if not any(isinstance(m, Core) for m in stage.modules()):
        return None
    meter, record = ActivationMeter.of([stage]), Selective("profile")
    work = WeightWork() if split else None
    inputs = stage.leaves(tuple(t.clone() for t in xs), source)
    meter.data([*(inputs if source else ()), *([loss.target] if isinstance(loss, Loss) else [])])
    with recording(work), record.active(stage), meter.saving():
        outs = forward_pass(stage, inputs, loss)
    meter.record(*outs, *(work.kept if work is not None else ()), *record.kept())
    held = meter.live()
    del outs, inputs, record, work
    return held


def edge_bytes(stage: StageModule, consumer: int, outs: Tensors) -> tuple[float, float]:
    """Bytes of one micro-batch from ``stage`` to ``consumer``: what the consumer reads of its
    outputs, and the gradients it sends back."""
    returned = stage.returned(consumer, outs)
    return nbytes(stage.handed(consumer, outs)), nbytes([outs[i] for i in returned])


def in_edges(stages: Mapping[int, StageModule], graph: StageGraph, c: int,
             outs: Mapping[int, Tensors], sizes: Mapping[str, Any]
             ) -> dict[int, tuple[float, float, float, float]]:
    """Per producer of stage ``c``: (bytes sent, gradient bytes back, bytes of them ``c``'s
    forward keeps, bytes of them its W holds after its B), from ``sizes["kept_inputs"]`` and
    ``sizes["kept_w_inputs"]`` (its profiled inputs, in producer order)."""
    out, at = {}, 0
    kept, kept_w = sizes["kept_inputs"], sizes["kept_w_inputs"]
    for p in graph.preds[c]:
        n = len(stages[p].handed(c, outs[p]))
        out[p] = (*edge_bytes(stages[p], c, outs[p]), float(sum(kept[at:at + n])),
                  float(sum(kept_w[at:at + n])))
        at += n
    return out


@dataclass(frozen=True)
class Loss:
    """A sink stage's loss on its micro-batch's ``target`` (data, as the batch: the executor
    counts neither as activations, and neither does ``stage_memory``)."""

    loss_fn: LossFn
    target: torch.Tensor

    def __call__(self, out: Tensors) -> torch.Tensor:
        return self.loss_fn(*out, self.target)  # type: ignore[no-any-return]


def loss_on(loss_fn: LossFn, target: torch.Tensor) -> Callable[[Tensors], torch.Tensor]:
    """A sink stage's loss on ``target`` (``Loss``)."""
    return Loss(loss_fn, target)
