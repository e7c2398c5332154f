"""Stopping list-scheduler builds that cannot beat the incumbent (``flexpipe.dsl.cutoff``),
remembered runs (``flexpipe.dsl.remember``) and the library's memory closed forms: the
scheduler's own times are the simulator's, a cut-off build always ends above the cutoff, and
every ``held`` rule is at most the simulated peak."""

from __future__ import annotations

import pytest

from flexpipe.cost import CostModel
from flexpipe.dsl.cutoff import Cutoff, CutoffReached
from flexpipe.dsl.policy import ListScheduler, Policy, policy_schedule
from flexpipe.dsl.remember import RUNS
from flexpipe.ir.placement import Placement
from flexpipe.schedules.registry import build, library
from flexpipe.search import fit_cost
from flexpipe.search.costs import rank_mb_act
from flexpipe.search.space import PLACEMENTS, policy_candidates
from flexpipe.search.space import build as build_candidate
from flexpipe.sim import simulate

COSTS = {"unit": (1.0, 1.0, 1.0, 0.0, 1.0), "1.5B": (18.522, 18.086, 9.337, 0.601, 0.5),
         "uneven": (1.0, 2.0, 0.7, 0.3, 1.0)}


def _cost(name: str, p: int) -> CostModel:
    f, b, w, c, wact = COSTS[name]
    return CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=wact, comm=c)


@pytest.mark.parametrize("times", sorted(COSTS))
@pytest.mark.parametrize("kind", sorted(PLACEMENTS))
def test_list_scheduler_times_are_the_simulators(times: str, kind: str) -> None:
    """The premise of the cutoff: each pass placed at the simulator's start time."""
    p, m = 4, 8
    placement = PLACEMENTS[kind](p)
    cost = fit_cost(_cost(times, p), placement.num_stages)
    for policy in (Policy(mem_limit=float(p), reserve="all"), Policy(split=False),
                   Policy(prefer=("F", "B", "W"), mem_limit=1.5 * p, reserve="none")):
        sched = ListScheduler(placement, m, cost, policy)
        orders = sched.run()
        trace = simulate(policy_schedule(placement, m, policy, cost), cost)
        assert [list(rank) for rank in trace.schedule.ranks] == orders
        for r, rank in enumerate(orders):
            assert list(trace.ends[r]) == pytest.approx([sched.end[op] for op in rank])


@pytest.mark.parametrize("times", sorted(COSTS))
@pytest.mark.parametrize("p", [4, 6])
def test_a_cut_off_build_ends_above_the_cutoff(times: str, p: int) -> None:
    """Every list-scheduler candidate, cut at 0.95, 0.999, 1 and 1.001 of its own makespan and
    span: stopped only below them; a build that is not stopped ends within the cutoff (with
    ``reserve="auto"`` a stopped "none" run hands over to "all", which may do better)."""
    m = 2 * p
    for cand in policy_candidates(p, m):
        if "builder" in cand.kwargs():
            continue
        placement = PLACEMENTS[cand.placement](p)
        cost = fit_cost(_cost(times, p), placement.num_stages)
        limits = (float(p),) * p
        try:
            met = simulate(build_candidate(cand, p, m, cost, limits), cost).metrics()
        except CutoffReached:
            raise
        except Exception:  # noqa: BLE001 - a candidate that does not fit: nothing to cut
            continue
        for measure, full in (("makespan", met.makespan), ("span", max(met.span))):
            for factor in (0.95, 0.999, 1.0, 1.001):
                RUNS.kept.clear()
                try:
                    got = build_candidate(cand, p, m, cost, limits, Cutoff(measure, full * factor))
                    done = simulate(got, cost).metrics()
                    value = done.makespan if measure == "makespan" else max(done.span)
                    assert value <= full * factor * (1 + 1e-9) + 1e-9, (cand.label, measure)
                except CutoffReached:
                    assert factor < 1.0, (cand.label, measure, factor)


def test_a_remembered_run_is_the_same_schedule() -> None:
    """The same inputs give the same orders whether remembered or not (lists and a uniform
    per-rank list are the same key as one number)."""
    p, m = 4, 8
    placement = Placement.vshape(p)
    cost = fit_cost(_cost("1.5B", p), placement.num_stages)
    RUNS.kept.clear()
    first = policy_schedule(placement, m, Policy(mem_limit=[4.0] * p, reserve="auto"), cost)
    assert RUNS.kept
    again = policy_schedule(placement, m, Policy(mem_limit=4.0, reserve="auto"), cost)
    RUNS.kept.clear()
    fresh = policy_schedule(placement, m, Policy(mem_limit=4.0, reserve="auto"), cost)
    assert first.ranks == again.ranks == fresh.ranks


@pytest.mark.parametrize("p, m", [(2, 3), (4, 6), (4, 16), (6, 12)])
def test_held_closed_forms_are_below_the_simulated_peak(p: int, m: int) -> None:
    """``Entry.held``: the micro-batches rank 0 holds at least (what the search prunes by)."""
    for name, entry in library().items():
        if entry.held is None:
            continue
        sched = build(name, p, m)
        cost = fit_cost(CostModel.uniform(p, p), sched.num_stages)
        peak = simulate(sched, cost).metrics().peak_activation[0]
        per_mb = rank_mb_act(cost, sched.placement)[0]
        assert entry.held(p, m) * per_mb <= peak + 1e-9, name


@pytest.mark.parametrize("times", sorted(COSTS))
def test_adaptive_v_reruns_stop_without_changing_the_schedule(
        times: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rerun of adaptive V stops once its worst idle time reaches the last run's: the same
    schedule as running every rerun to its end."""
    import flexpipe.schedules.vgreedy as vg

    p, m = 6, 18
    cost = fit_cost(_cost(times, p), 2 * p)
    limits = (4.0, 6.0)
    fast = [vg.v_adaptive.__wrapped__(p, m, cost, mem_limit=x) for x in limits]  # type: ignore[attr-defined]
    full = vg._attempt
    monkeypatch.setattr(vg, "_attempt", lambda *args: full(*args[:8]))
    slow = [vg.v_adaptive.__wrapped__(p, m, cost, mem_limit=x) for x in limits]  # type: ignore[attr-defined]
    assert [s.ranks for s in fast] == [s.ranks for s in slow]
