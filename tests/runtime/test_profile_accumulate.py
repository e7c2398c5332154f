"""The profile times W and the fused BW adding into existing weight gradients, as a training
step does (its ``zero_grad(set_to_none=False)`` keeps them): a W timed into no gradient takes
the product as the gradient and skips the add, which reads and writes every weight's worth of
memory (on the 2-core machine GPT-2's W at hidden 512 was profiled short by it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexpipe.ir.placement import Placement
from flexpipe.runtime.measurement import profile
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.split import WeightWork

TINY = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)
REPS = 3


def test_w_adds_into_kept_gradients_in_every_timed_round(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    items, _, _ = profile._stages_of((TINY, Placement.linear(1), None), 0, torch.device("cpu"))
    rounds: list[list[bool]] = []  # per round, per gradient W adds: was there one to add into?
    real_round, real_run = profile._round, WeightWork.run
    inside = [False]  # the memory measurement after the rounds also runs a W: not a round's

    def in_round(*args: Any) -> dict[str, float]:
        rounds.append([])
        inside[0] = True
        try:
            return real_round(*args)
        finally:
            inside[0] = False

    def seen(work: WeightWork) -> None:
        if inside[0]:
            rounds[-1].extend(p.grad is not None for p in work.deferred.values())
        real_run(work)

    monkeypatch.setattr(profile, "_round", in_round)
    monkeypatch.setattr(WeightWork, "run", seen)
    profile.time_stages(items, REPS)
    # on a CPU each repetition is a hot and a cold round; the hot ones after two warm-ups
    assert len(rounds) == 2 * REPS + profile.WARM_UP and all(rounds)
    # only the first round's W finds no gradient (it creates them); every later W and BW adds
    assert not all(rounds[0]) and all(all(r) for r in rounds[1:])
    # and the profile leaves no gradients behind
    assert all(p.grad is None for stage, *_ in items for p in stage.parameters())
