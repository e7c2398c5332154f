"""The F handler of an evaluation step (``Pipeline.eval``, the validation loss of ``flexpipe
run``): a forward without autograd whose sink outputs are kept per micro-batch."""

from __future__ import annotations

import torch

from flexpipe.ir.op import Op
from flexpipe.runtime.execution.executor import Executor
from flexpipe.runtime.execution.rng import drawing
from flexpipe.runtime.execution.stage import Tensors


class EvalForward:
    """The F handler of an evaluation step: the stage forward without autograd; a sink stage's
    outputs are kept per micro-batch instead of going to the loss."""

    def __init__(self) -> None:
        self.outputs: dict[int, Tensors] = {}

    def __call__(self, ex: Executor, op: Op) -> None:
        ex.require_params(op)
        inputs, _ = ex.take_inputs(op)
        with torch.no_grad(), drawing(ex.draw(op)):
            out = ex.stages[op.stage](*inputs)
        if op.stage in ex.sinks:
            self.outputs[ex.sample(op)] = tuple(t.detach() for t in out)
        else:
            ex.hand_forward(op, out)
