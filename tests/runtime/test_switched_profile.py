"""The profiler's switched rounds (``profile.time_stages(groups=)``): the stages one schedule
puts on a rank together (a V-shape's two) are also timed with their passes interleaved, each
pass right after another stage's, for their ``cold`` times; a stage alone on its rank gets
none, and the cost model carries what was measured."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flexpipe.ir.placement import Placement
from flexpipe.runtime.measurement import profile
from flexpipe.runtime.models.spec import ModelSpec

TINY = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)


def _items(placement: Placement) -> list[profile.Timed]:
    items, _, _ = profile._stages_of((TINY, placement, None), 0, torch.device("cpu"))
    return items


def test_a_switched_round_interleaves_the_stages_pass_by_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    items = _items(Placement.vshape(1))  # stages 0 and 1 on the one rank
    order: list[tuple[int, str]] = []
    for n, (stage, *_) in enumerate(items):
        for name in ("forward",):
            real = getattr(stage, name)

            def seen(*args: Any, _n: int = n, _real: Any = real) -> Any:
                order.append((_n, "forward"))
                return _real(*args)
            monkeypatch.setattr(stage, name, seen)
    got = profile._steps(items, profile.clock(torch.device("cpu")))
    assert [set(t) for t in got] == [{"F", "B", "W", "BW"}] * 2
    # each stage's two forwards (F, then BW's) alternate with the other stage's
    assert [n for n, _ in order] == [0, 1, 0, 1]


def test_grouped_stages_get_cold_times_and_a_lone_stage_none() -> None:
    v, lone = _items(Placement.vshape(1)), _items(Placement.linear(1))
    got = profile.time_stages([*v, *lone], reps=1, groups=[range(2), range(2, 3)])
    assert [set(g["cold"]) for g in got] == [{"F", "B", "W", "BW"}] * 2 + [set()]
    assert all(t > 0 for g in got[:2] for t in g["cold"].values())
    alone = profile.time_stages(v, reps=1, groups=[[0], [1]])
    assert [g["cold"] for g in alone] == [{}, {}]


def test_the_cost_model_carries_the_cold_times() -> None:
    stage = {"F": 1.0, "B": 2.0, "W": 3.0, "BW": 5.0, "SR": 0.0, "act": 1.0, "wact": 1.0,
             "input": 0.0, "params": 0.0, "out_bytes": 0.0}
    results = [{"stages": {0: stage | {"cold": {"F": 1.5}}, 1: stage | {"cold": {}}},
                "links": {}}]
    cost = profile.to_cost_model(results, 2)
    assert cost.stage(0).cold == {"F": 1.5} and cost.stage(1).cold == {}
    assert cost.stage(0).switched_time("F") == 1.5 and cost.stage(1).switched_time("F") == 1.0
