"""Tessel's placement cases as graph presets: the graph search finds their zero-bubble
repetends (periods 4, 6, 8, 8 per micro-batch on 4 devices, memory 20)."""

from __future__ import annotations

import pytest

from flexpipe.graphs import preset, preset_layouts
from flexpipe.graphs.tessel import PERIOD
from flexpipe.search.graphs import search_graph
from flexpipe.search.repetend import repetend_schedules, steady_period
from flexpipe.sim.validate import validate


@pytest.mark.parametrize("name", sorted(PERIOD))
def test_tessel_preset_work_per_device_is_the_period(name: str) -> None:
    gm = preset(name, 4)
    work = [0.0] * 4
    for s, r in enumerate(gm.placement.stage_rank):
        work[r] += sum(gm.cost.stage(s).time(k) for k in "FBW")
    assert work == [PERIOD[name]] * 4


@pytest.mark.parametrize("name", sorted(PERIOD))
def test_repetend_tiles_at_the_period(name: str) -> None:
    gm = preset(name, 4)
    got = repetend_schedules(gm, 24, 20.0)
    assert got, "CP-SAT found no repetend"
    label, sched = got[0]
    assert f"T={PERIOD[name]}" in label
    assert validate(sched, gm.cost, 20.0) == []
    assert steady_period(sched, gm.cost) == pytest.approx(PERIOD[name])


def test_graph_search_reaches_the_nn_period() -> None:
    """Tessel's nn case at memory 20: the search's best runs one micro-batch every 8 units in
    the steady phase (list scheduling alone: about 8.6)."""
    models = preset_layouts("tessel-nn", 4)
    res = search_graph(models, 24, 20.0)
    assert res.best is not None
    assert steady_period(res.best, models[0].cost) <= PERIOD["tessel-nn"] + 1e-9
