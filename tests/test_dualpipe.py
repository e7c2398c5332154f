"""DualPipe, the two-way schedule (``flexpipe.schedules.dualpipe_twoway``), against DeepSeek's
published table (DeepSeek-V3 report, table 2; docs/facts.md): by the simulator on unit costs at
several p and n, its bubble is (PP/2 - 1)(F&B + B - 3W), its parameters 2x and its activations
PP + 1 chunks, where 1F1B has (PP - 1)(F + B), 1x, PP and ZB1P (PP - 1)(F + B - 2W), 1x, PP.
B in the table is a chunk's full backward, here the input-gradient B plus W."""

from __future__ import annotations

import pytest

from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.errors import ConfigError, InfeasibleError
from flexpipe.ir.overlap import pair_time
from flexpipe.ir.text import parse_schedule
from flexpipe.ir.torch_csv import to_torch_csv
from flexpipe.schedules.dualpipe_twoway import model_stage
from flexpipe.schedules.registry import build
from flexpipe.sim.engine import simulate
from flexpipe.sim.validate import validate

PS = (2, 4, 6, 8)
TIMES = [(1.0, 1.0, (0.0, 0.0)), (1.0, 0.5, (0.0, 0.0)), (1.2, 0.3, (0.0, 0.0)),
         (1.0, 0.8, (0.4, 0.5))]


def _cost(stages: int, p: int, f: float, b: float, w: float, comm: tuple[float, float] = (0, 0),
          act: float = 1.0, params: float = 1.0) -> CostModel:
    """Every stage alike: times (f, b, w, communication parts), activation and parameters."""
    times = {"F": f, "B": b, "W": w, "F_COMM": comm[0], "BW_COMM": comm[1]}
    stage = StageCost(times, act=act, wact=act / 2, input=act / 8, params=params)
    return CostModel((stage,) * stages, Comm.uniform(p))


def _bubble(name: str, p: int, n: int, cost: CostModel) -> float:
    """The worst rank's idle time: the makespan less the least busy rank's work."""
    metrics = simulate(build(name, p, n), cost).metrics()
    return metrics.makespan - min(metrics.busy)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("f,w,comm", TIMES)
@pytest.mark.parametrize("per_direction", [1, 2, 3])
def test_dualpipe_bubble_is_deepseeks(p: int, f: float, w: float, comm: tuple[float, float],
                                      per_direction: int) -> None:
    """(PP/2 - 1)(F&B + B - 3W) with PP = p ranks, F&B the overlapped slot of a forward and a
    full backward, at n = 2p, 4p and 6p micro-batches in all (p, 2p, 3p per direction); the
    table's derivation takes a chunk's F and input-gradient B equal."""
    b = f
    cost = _cost(2 * p, p, f, b, w, comm)
    slot = pair_time((f, comm[0]), (b + w, comm[1]))
    expected = (p // 2 - 1) * (slot + (b + w) - 3 * w)
    assert _bubble("dualpipe", p, per_direction * p, cost) == pytest.approx(expected)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("f,w,comm", TIMES[:3])
def test_1f1b_and_zb1p_bubbles_are_the_tables(p: int, f: float, w: float,
                                              comm: tuple[float, float]) -> None:
    """The table's baselines on the same simulator: 1F1B (PP - 1)(F + B) and ZB1P (ZB-H1)
    (PP - 1)(F + B - 2W), B the full backward; DualPipe's is smaller at every p."""
    b = f
    cost = _cost(p, p, f, b, w)
    one_f_one_b = _bubble("1f1b", p, 4 * p, cost)
    zb1p = _bubble("zb-h1", p, 4 * p, cost)
    assert one_f_one_b == pytest.approx((p - 1) * (f + b + w))
    assert zb1p == pytest.approx((p - 1) * (f + (b + w) - 2 * w))
    dual = _bubble("dualpipe", p, 2 * p, _cost(2 * p, p, f, b, w))
    assert dual < zb1p


@pytest.mark.parametrize("p", PS)
def test_dualpipe_holds_2x_parameters_and_pp_plus_one_activations(p: int) -> None:
    """Parameters per device 2x (a model stage of each direction on every rank) and activation
    PP + 1 chunks, against 1F1B's and ZB1P's 1x and PP."""
    no_act = _cost(2 * p, p, 1.0, 1.0, 1.0, act=0.0)
    assert simulate(build("dualpipe", p, p), no_act).metrics().peak_memory == (2.0,) * p
    acts = _cost(2 * p, p, 1.0, 1.0, 1.0, params=0.0)
    assert max(simulate(build("dualpipe", p, 2 * p), acts).metrics().peak_activation) == \
        pytest.approx(p + 1)
    for name in ("1f1b", "zb-h1"):
        flat = _cost(p, p, 1.0, 1.0, 1.0, act=0.0)
        assert simulate(build(name, p, 2 * p), flat).metrics().peak_memory == (1.0,) * p
        flat_acts = _cost(p, p, 1.0, 1.0, 1.0, params=0.0)
        assert max(simulate(build(name, p, 2 * p), flat_acts).metrics().peak_activation) == \
            pytest.approx(p)


@pytest.mark.parametrize("p", PS)
def test_every_rank_holds_one_stage_of_each_direction(p: int) -> None:
    """Rank r: model stage r on the way down and model stage p-1-r on the way up, fed from
    both ends (each chain's first stage on rank 0 and rank p-1)."""
    sched = build("dualpipe", p, p)
    graph = sched.graph
    assert graph.sources() == (0, p) and graph.sinks() == (p - 1, 2 * p - 1)
    for r, stages in enumerate(sched.placement.rank_stages):
        assert sorted(model_stage(s, p) for s in stages) == sorted({r, p - 1 - r})
        assert {s < p for s in stages} == {True, False}


def test_dualpipe_overlaps_its_steady_phase_and_round_trips() -> None:
    """Its steady phase is overlapped F&B pairs; the text form gives it back (graph and pairs
    included); torch's CSV, which holds a chain of stages (its reader infers one), refuses its
    two directions by name rather than write what reads back as another schedule."""
    sched = build("dualpipe", 4, 8)
    assert validate(sched) == []
    assert len(sched.overlaps) >= 4 * 4
    assert parse_schedule(sched.to_text()) == sched
    with pytest.raises(ConfigError, match="holds a chain of stages.*use the text format"):
        to_torch_csv(sched)


@pytest.mark.parametrize("p,m,why", [(3, 6, "even number of ranks"),
                                     (4, 3, "at least p = 4 micro-batches per direction")])
def test_dualpipe_refuses_odd_ranks_and_too_few_micro_batches(p: int, m: int, why: str) -> None:
    with pytest.raises(InfeasibleError, match=why):
        build("dualpipe", p, m)
