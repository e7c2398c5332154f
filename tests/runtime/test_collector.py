"""Python's collector stays out of the pipeline's steps (``runtime/execution/collector``): a full
collection over an exported model's objects stalled a forward by 225 ms and every rank with
it. During a step the automatic collector is off; afterwards it is as it was."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.runtime.execution import collector


class Probe(nn.Module):
    """A layer that notes whether the automatic collector is on while it computes."""

    def __init__(self, seen: list[bool]) -> None:
        super().__init__()
        self.lin, self.seen = nn.Linear(4, 4), seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(gc.isenabled())
        return self.lin(x)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_no_automatic_collection_inside_a_step(schedule: str) -> None:
    seen: list[bool] = []
    pipe = flexpipe.pipeline([Probe(seen), Probe(seen)], schedule, m=2,
                             loss_fn=lambda out, y: fn.mse_loss(out, y))
    assert gc.isenabled()
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    assert seen and not any(seen)
    assert gc.isenabled()  # restored after the step


def test_paused_restores_a_disabled_collector() -> None:
    gc.disable()
    try:
        with collector.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_between_steps_young_generations_and_a_full_pass_every_50(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    for step in range(100):
        collector.collect_after(step)
    assert calls.count(2) == 2 and calls.count(1) == 98
    assert [i for i, g in enumerate(calls) if g == 2] == [49, 99]
