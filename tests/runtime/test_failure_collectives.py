"""A failure on one rank also reaches the ranks blocked in a collective with it: at pp 2 x dp 2
(4 gloo ranks), a forward raising on global rank 0 only, under FSDP2 (``fsdp=True``: the other
replica waits in its reduce-scatter) and with the overlapped gradient reduction, makes every
rank raise the same error naming rank 0, its stage and micro-batch, and saying the pipeline
cannot run again. The ranks' timeouts are far beyond the test's own limit, so a failure learnt
by a timeout fails the test instead of passing late. In the shared 4-rank launch
(``shared_launch``)."""

from __future__ import annotations

import pytest
import shared_launch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import FlexPipeError

M, DP = 2, 2
CASES = ({"fsdp": True}, {"overlap_reduce": True})
ARMED: dict[str, int] = {}


class Trap(nn.Module):
    """Identity, raising at this process's second call while armed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "calls" in ARMED:
            ARMED["calls"] += 1
            if ARMED["calls"] == 2:
                ARMED.clear()
                raise ValueError("the trap was sprung")
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Trap(), nn.Tanh(), nn.Linear(8, 3))


def _said(options: dict[str, bool]) -> str:
    pipe = flexpipe.pipeline(_model().double(), "1f1b", loss_fn=fn.cross_entropy, m=M, dp=DP,
                             timeout_s=3000.0, **options)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * M,), generator=gen)
    if dist.get_rank() == 0:
        ARMED["calls"] = 0
    try:
        pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    except FlexPipeError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        ARMED.clear()
    return "returned"


def failing_main() -> list[str]:
    """What each case's step said on this rank."""
    return [_said(options) for options in CASES]


shared_launch.register(4, "failure-collectives", lambda: (failing_main, ()))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_failure_reaches_the_ranks_in_a_collective_with_it() -> None:
    results = shared_launch.results(4, "failure-collectives")
    for i, options in enumerate(CASES):
        for rank, per_case in enumerate(results):
            said = per_case[i]
            assert "rank 0" in said and "the trap was sprung" in said, (options, rank, said)
            assert "micro-batch 1" in said and "stage 0" in said, (options, rank, said)
            assert "cannot" in said, (options, rank, said)
