"""The static memory a rank holds after an optimizer step, as measured: its parameters (the
float32 masters under mixed precision), their gradients, the optimizer's state and, under
mixed precision, the compute copies (``precision.Casting``), every storage counted once
(``fsdp.held_bytes``). ``memory_check.memory_cost`` predicts it per stage
(``StageCost.params``): the test of mixed precision compares the two."""

from __future__ import annotations

import torch

from flexpipe.runtime.execution.fsdp import held_bytes
from flexpipe.runtime.execution.worker import RankWorker


def static_held(worker: RankWorker, optimizer: torch.optim.Optimizer) -> float:
    """Bytes of ``worker``'s parameters, gradients, compute copies and ``optimizer``'s state
    tensors, each storage once."""
    tensors: list[torch.Tensor | None] = [
        t for m in worker.stages.values() for p in m.parameters() for t in (p, p.grad)]
    tensors += [t for sh in worker.shards.values() for p in sh.params for t in (p, p.grad)]
    tensors += [t for state in optimizer.state.values() for t in state.values()
                if isinstance(t, torch.Tensor)]
    if worker.casting is not None:
        tensors += list(worker.casting.copies.values())
    return held_bytes(tensors)
