"""A schedule family's facts live on its registry entry, and the search and the planner read them
from there: every entry's declared placement is the one its generator builds, and a family
registered under a new name (here a V-shaped one) is found by the search and the planner with no
edit anywhere else."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.plan import Cluster, Device, Layer, Model, Options, plan
from flexpipe.plan.problem import square
from flexpipe.schedules import registry
from flexpipe.schedules.vshape import v_half
from flexpipe.search import fit_cost, search
from flexpipe.sim import simulate

P, M = 4, 8


def vee(p: int, m: int, cost: CostModel | None = None) -> Schedule:
    """A V-shaped schedule under a name the library does not know."""
    return v_half(p, m, cost).renamed("vee")


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registry reduced to 1F1B for the test's duration; registrations are undone after."""
    monkeypatch.setattr(registry, "_LIBRARY", {"1f1b": registry.library()["1f1b"]})
    yield


@pytest.mark.parametrize("name", registry.names())
def test_declared_placement_is_the_built_one(name: str) -> None:
    entry = registry.library()[name]
    for key, values in [*entry.grid, ("", (None,))]:
        kw = {key: values[-1]} if key else {}
        built = registry.build(name, P, M, **kw)
        declared = entry.placement_for(P, **kw)
        assert built.placement.stage_rank == declared.stage_rank, (name, kw)
        assert entry.chunks(P, **kw) == built.num_stages // P


@pytest.mark.usefixtures("only")
def test_a_registered_v_schedule_is_found_by_the_search() -> None:
    registry.register("vee", vee, placement=registry.vshape)
    fitted = fit_cost(CostModel.uniform(P, P), 2 * P)
    limit = max(simulate(vee(P, M, fitted), fitted).metrics().peak_activation)
    result = search(None, P, M, limit, synthesis=False)
    trials = {t.family: t for t in result.trials}
    assert trials["1f1b"].status in ("over memory", "pruned (memory)")
    assert trials["vee"].status == "best" and trials["vee"].placement == "vshape"
    assert result.best is not None and result.best.placement.kind == "vshape"


@pytest.mark.usefixtures("only")
def test_the_search_reads_the_placement_from_the_entry() -> None:
    registry.register("vee", vee)  # wrongly declared linear: the cost model does not fit
    trial = next(t for t in search(None, P, M, 100.0, synthesis=False).trials
                 if t.family == "vee")
    assert trial.status == "invalid"


@pytest.mark.usefixtures("only")
def test_a_registered_family_is_planned() -> None:
    registry.register("vee", vee, placement=registry.vshape)
    model = Model("eight", tuple(Layer(f"l{i}", 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0)
                                  for i in range(8)), M, (1,))
    cluster = Cluster("four", tuple(Device(1e9) for _ in range(P)), square(P, 0.0, 0.0),
                      square(P, 1e6, math.inf))
    best = plan(model, cluster, Options(families=("vee",), refine_seconds=0.0,
                                        polish_seconds=0.0))
    assert best.best.candidate.family == "vee"
    assert best.best.schedule.placement.kind == "vshape"


@pytest.mark.usefixtures("only")
def test_registering_checks_the_facts() -> None:
    with pytest.raises(ConfigError, match="grid"):
        registry.register("vee", vee, grid=(("w", (1, 2)),))
    registry.register("vee", vee, placement=registry.vshape)
    registry.register("vee", vee, placement=registry.vshape)  # the same family again: no-op
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("vee", v_half)
