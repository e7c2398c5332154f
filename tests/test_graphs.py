"""Stage graphs beyond chains: forks, joins and gangs (blocks spanning several devices) through
the text format, the validator, the simulator (timings worked out by hand), the list scheduler,
the CP-SAT optimiser, the model presets, their search and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexpipe.cli.main import main
from flexpipe.cost.model import Comm, CostModel, StageCost
from flexpipe.errors import ConfigError, DeadlockError, ParseError
from flexpipe.graphs import PRESETS, balanced_cut, chain_baseline, preset, preset_layouts
from flexpipe.graphs.model import work
from flexpipe.ir import Op, Placement, Schedule, StageGraph
from flexpipe.ir.text import format_schedule, parse_schedule
from flexpipe.search import repetend
from flexpipe.search.graphs import depths, search_graph
from flexpipe.sim import simulate
from flexpipe.sim.validate import check, validate

KINDS = ("F", "B", "W", "BW", "R")


@st.composite
def graph_schedules(draw: st.DrawFn) -> Schedule:
    """A random DAG with random gangs (members on distinct ranks) and random op tokens."""
    n = draw(st.integers(2, 7))
    p = draw(st.integers(2, 4))
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    edges = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=8))
    order = draw(st.permutations(range(n)))
    gangs, kinds, ranks = [], [], [0] * n
    free = list(order)
    while len(free) >= 2 and draw(st.booleans()):
        size = draw(st.integers(2, min(p, len(free))))
        gang, free = tuple(free[:size]), free[size:]
        if any((a in gang) and (b in gang) for a, b in edges):
            continue
        gangs.append(gang)
        kinds.append(tuple(draw(st.lists(st.sampled_from(("F", "B", "BW")), unique=True,
                                          max_size=2))))
        for i, s in enumerate(gang):
            ranks[s] = i
    for s in free:
        ranks[s] = draw(st.integers(0, p - 1))
    graph = StageGraph(n, tuple(edges), tuple(gangs), tuple(kinds) if gangs else ())
    m = draw(st.integers(1, 3))
    per_rank: list[list[Op]] = [[] for _ in range(p)]
    for s in range(n):
        for _ in range(draw(st.integers(0, 2))):
            per_rank[ranks[s]].append(Op(draw(st.sampled_from(KINDS)), s, draw(st.integers(0, 2))))
    name = draw(st.sampled_from(["", "two towers"]))
    return Schedule.build(per_rank, Placement(tuple(ranks), p), m, graph, name)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_schedules())
def test_text_round_trips_graphs_with_edges_and_gangs(schedule: Schedule) -> None:
    text = format_schedule(schedule)
    back = parse_schedule(text)
    assert back == schedule
    assert back.graph.gangs == schedule.graph.gangs
    assert back.graph.gang_kinds == schedule.graph.gang_kinds
    assert format_schedule(back) == text


HEAD = ("flexpipe-schedule v1\nranks: 2 stages: 4 microbatches: 2\nplacement: 0 1 0 1\n"
        "edges: 0>2 1>2 2>3\n")
GANG_OK = HEAD + ("gangs: 0,1\n"
                  "rank 0: 0F0 2F0 0F1 2F1 2BW0 0BW0 2BW1 0BW1\n"
                  "rank 1: 1F0 3F0 1F1 3F1 3BW0 1BW0 3BW1 1BW1\n")


@pytest.mark.parametrize(("gangs", "line", "column", "needle"), [
    ("gangs: 0,1 2", 5, 12, "expected a gang"),
    ("gangs: 0,1:f", 5, 8, "expected a gang"),
    ("gangs: 1,3", 5, 1, "two stages on one rank"),
    ("gangs: 0,1 1,3", 5, 1, "in two gangs"),
    ("gangs: 2,3", 5, 1, "cannot feed each other"),
])
def test_gang_parse_errors_name_line_and_column(gangs: str, line: int, column: int,
                                                needle: str) -> None:
    text = GANG_OK.replace("gangs: 0,1", gangs)
    with pytest.raises(ParseError) as err:
        parse_schedule(text)
    assert (err.value.line, err.value.column) == (line, column)
    assert needle in str(err.value)


def test_graph_rejects_bad_gangs() -> None:
    with pytest.raises(ConfigError, match="at least two"):
        StageGraph(3, (), ((1,),))
    with pytest.raises(ConfigError, match="outside"):
        StageGraph(3, (), ((1, 5),))
    with pytest.raises(ConfigError, match="gang_kinds lists"):
        StageGraph(3, (), ((0, 1),), (("F",), ("B",)))


def two_towers(m: int = 2) -> tuple[StageGraph, Placement]:
    """Tower 0 on rank 0, tower 1 and the joining loss stage 2 on rank 1."""
    return StageGraph(3, ((0, 2), (1, 2))), Placement((0, 1, 1), 2)


def test_validator_catches_a_join_before_its_input() -> None:
    graph, pl = two_towers()
    bad = Schedule.build([[Op("F", 0, 0), Op("BW", 0, 0)],
                          [Op("F", 2, 0), Op("F", 1, 0), Op("BW", 2, 0), Op("BW", 1, 0)]],
                         pl, 1, graph)
    found = validate(bad)
    assert [v.rule for v in found] == ["order"]
    assert found[0].op == "2F0" and "1F0" in found[0].reason
    good = Schedule.build([[Op("F", 0, 0), Op("BW", 0, 0)],
                           [Op("F", 1, 0), Op("F", 2, 0), Op("BW", 2, 0), Op("BW", 1, 0)]],
                          pl, 1, graph)
    assert validate(good) == []
    late = good.with_ranks([[Op("BW", 0, 0), Op("F", 0, 0)], good.ranks[1]])
    assert "needs 0F0" in " ".join(v.reason for v in validate(late))


def test_validator_reports_inconsistent_gang_orders_as_a_deadlock_cycle() -> None:
    assert validate(parse_schedule(GANG_OK)) == []
    bad = GANG_OK.replace("rank 1: 1F0 3F0 1F1", "rank 1: 1F1 1F0 3F0")
    with pytest.raises(DeadlockError) as err:
        check(parse_schedule(bad))
    reason = err.value.violations[0].reason
    assert "rank 0 waits at 0F0 for 1F1 on rank 1" in reason
    assert "rank 1 waits at 1F1" in reason


def stage(f: float, b: float, w: float) -> StageCost:
    return StageCost({"F": f, "B": b, "W": w}, act=1.0, wact=1.0)


def test_simulator_times_a_fork_and_join_by_hand() -> None:
    graph = StageGraph(4, ((0, 1), (0, 2), (1, 3), (2, 3)))
    pl = Placement((0, 1, 2, 3), 4)
    cost = CostModel((stage(1, 1, 1), stage(2, 2, 1), stage(3, 1, 1), stage(1, 1, 1)),
                     Comm.uniform(4, 0.5))
    sched = Schedule.build([[Op(k, r, 0) for k in "FBW"] for r in range(4)], pl, 1, graph)
    trace = simulate(sched, cost)
    assert trace.starts == ((0.0, 10.0, 11.0), (1.5, 7.5, 9.5), (1.5, 7.5, 8.5), (5.0, 6.0, 7.0))
    assert trace.metrics().makespan == 12.0


def test_simulator_starts_a_gang_together_by_hand() -> None:
    cost = CostModel((stage(1, 1, 1), stage(3, 1, 1), stage(2, 2, 2), stage(2, 2, 2)),
                     Comm.uniform(2))
    trace = simulate(parse_schedule(GANG_OK), cost)
    assert trace.starts == ((0.0, 3.0, 7.0, 10.0, 18.0, 22.0, 28.0, 32.0),
                            (0.0, 5.0, 7.0, 12.0, 14.0, 22.0, 24.0, 32.0))


def test_non_collective_kinds_of_a_gang_run_alone() -> None:
    cost = CostModel((stage(1, 1, 1), stage(3, 1, 1), stage(2, 2, 2), stage(2, 2, 2)),
                     Comm.uniform(2))
    free = parse_schedule(GANG_OK.replace("gangs: 0,1", "gangs: 0,1:B"))
    starts = simulate(free, cost).starts
    assert starts[0][2] == 5.0  # 0F1 right after 2F0, no longer waiting for rank 1's 3F0


def gang_starts_agree(schedule: Schedule, cost: CostModel) -> None:
    trace = simulate(schedule, cost)
    when = {op: t for r, ops in enumerate(schedule.ranks)
            for op, t in zip(ops, trace.starts[r], strict=True)}
    for op, t in when.items():
        for s in schedule.graph.members(op.stage, op.kind):
            assert when[Op(op.kind, s, op.mb)] == pytest.approx(t)


def test_exact_optimiser_proves_a_tiny_two_tower_optimal() -> None:
    pytest.importorskip("ortools")
    from flexpipe.search.exact import solve

    graph, pl = two_towers()
    cost = CostModel.uniform(3, 2)
    report = solve(pl, 2, cost, [10.0, 10.0], graph=graph, time_limit=20)
    assert report.status == "OPTIMAL"
    assert report.objective == report.bound == 12.0  # rank 1 runs 2 stages x 2 mbs x 3 passes
    assert report.schedule is not None and report.schedule.graph == graph
    assert validate(report.schedule) == []
    assert max(simulate(report.schedule, cost).metrics().span) == 12.0


def test_balanced_cut_is_optimal_against_brute_force() -> None:
    layers = [stage(t, t, 0) for t in (3, 1, 4, 1, 5, 9, 2, 6)]
    for k in (1, 2, 3, 5, 8):
        got = max(work(s) for s in balanced_cut(layers, k))
        best = min(max(sum(2 * t for t in part) for part in parts)
                   for parts in _partitions([3, 1, 4, 1, 5, 9, 2, 6], k))
        assert got == best
    with pytest.raises(ConfigError, match="cannot cut"):
        balanced_cut(layers, 9)


def _partitions(xs: list[int], k: int) -> list[list[list[int]]]:
    if k == 1:
        return [[xs]]
    return [[xs[:i], *rest] for i in range(1, len(xs) - k + 2)
            for rest in _partitions(xs[i:], k - 1)]


def test_depth_generalises_one_f_one_b_warm_up() -> None:
    chain = StageGraph.chain(4)
    assert depths(chain, (0, 1, 2, 3), 4) == (4, 3, 2, 1)
    model = preset("encdec", 4, "vshape")
    assert depths(model.graph, model.placement.stage_rank, 4)[0] == 5 + 3


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_validates_simulates_and_is_searched(name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """(CP-SAT's repetend search gets a tenth of its effort: what is checked here holds for
    whatever it finds, and the sharded-vocabulary preset spent 23 of its 25 s there.)"""
    monkeypatch.setattr(repetend, "EFFORT", repetend.EFFORT / 10)
    p, m = 4, 4
    models = preset_layouts(name, p)
    assert all(gm.graph.num_stages == gm.cost.num_stages for gm in models)
    assert any(not gm.graph.is_chain for gm in models) or name == "tessel-v"  # Tessel's chain
    result = search_graph(models, m)
    assert result.best is not None and result.best_trial is not None
    best_model = next(gm for gm in models if gm.layout == result.best_trial.placement)
    check(result.best, best_model.cost, mem_limit=None)
    trace = simulate(result.best, best_model.cost)
    assert max(trace.metrics().peak_activation) <= result.limits[0] * (1 + 1e-9)
    assert max(trace.metrics().span) >= result.lower_bound * (1 - 1e-9)
    gang_starts_agree(result.best, best_model.cost)
    assert parse_schedule(result.best.to_text()) == result.best
    base, base_cost = chain_baseline(models[0], m)
    assert validate(base) == [] and base_cost.num_stages == p


def test_gpt_preset_shards_embedding_and_head_over_every_device() -> None:
    gm = preset("gpt-sharded-vocab", 4)
    embed, head = gm.graph.gangs
    assert [gm.placement.stage_rank[s] for s in embed] == [0, 1, 2, 3]
    assert [gm.placement.stage_rank[s] for s in head] == [0, 1, 2, 3]
    assert gm.graph.members(head[0], "F") == head and gm.graph.members(head[0], "W") == head[:1]
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("nope", 4)
    with pytest.raises(ConfigError, match="no layout"):
        preset("clip", 4, "diagonal")


def test_cli_searches_a_preset_and_reuses_its_cost(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "best.txt"
    assert main(["search", "--preset", "clip", "-p", "2", "-m", "2", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chain-only 1F1B baseline" in text and "best:" in text
    assert main(["simulate", str(out), "--cost", "preset:clip"]) == 0
    assert main(["search", "-p", "2", "-m", "2"]) == 2
    assert "-m and --mem are required" in capsys.readouterr().err
    out2 = tmp_path / "encdec.txt"
    assert main(["search", "--preset", "encdec", "-p", "2", "-o", str(out2)]) == 0
    assert parse_schedule(out2.read_text()).microbatches == 6  # default m = 3p


def test_search_entry_point_takes_graph_layouts() -> None:
    from flexpipe.search import search

    models = preset_layouts("encdec", 2)
    result = search(None, 2, 2, None, graph=models)
    assert result.best is not None
    assert {t.placement for t in result.trials} == {gm.layout for gm in models}
    with pytest.raises(ConfigError, match="own cost model"):
        search(CostModel.uniform(2, 2), 2, 2, None, graph=models)
    with pytest.raises(ConfigError, match="p = 3"):
        search(None, 3, 2, None, graph=models)
    with pytest.raises(ConfigError, match="memory limit"):
        search(None, 2, 2, None)


def test_graph_search_with_the_exact_step_on_a_small_two_tower() -> None:
    pytest.importorskip("ortools")
    models = preset_layouts("clip", 2)
    plain = search_graph(models, 2)
    result = search_graph(models, 2, exact=True, time_limit=5)
    assert result.exact is not None and result.exact["status"] in ("OPTIMAL", "FEASIBLE")
    assert result.best_trial is not None and plain.best_trial is not None
    assert result.best_trial.span <= plain.best_trial.span * (1 + 1e-9)  # type: ignore[operator]
    assert validate(result.best) == []  # type: ignore[arg-type]


@pytest.mark.parametrize("gang_wait", [True, False])
def test_list_scheduler_runs_each_collective_for_its_whole_gang(gang_wait: bool) -> None:
    from flexpipe.dsl.policy import Policy, policy_schedule

    gm = preset("gpt-sharded-vocab", 4, "sharded-interleaved")
    schedule = policy_schedule(gm.placement, 6, Policy(gang_wait=gang_wait), gm.cost, gm.graph)
    assert validate(schedule) == []
    gang_starts_agree(schedule, gm.cost)
    heads = gm.graph.gangs[1]
    trace = simulate(schedule, gm.cost)
    head_w = [t for r, ops in enumerate(schedule.ranks)
              for op, t in zip(ops, trace.starts[r], strict=True)
              if op.kind == "W" and op.stage in heads and op.mb == 0]
    assert len(set(head_w)) > 1  # W is not collective: the shards' weight gradients run apart


def test_lowering_a_graph_with_gangs_keeps_its_timing() -> None:
    from flexpipe.dsl.policy import Policy, policy_schedule
    from flexpipe.ir.lower import lower

    for gm in (preset("gpt-sharded-vocab", 4, "sharded-vshape"), preset("encdec", 4, "vshape")):
        schedule = policy_schedule(gm.placement, 4, Policy(), gm.cost, gm.graph)
        low = lower(schedule)
        assert validate(low) == [] and len(low) > len(schedule)
        assert simulate(low, gm.cost).metrics().makespan == pytest.approx(
            simulate(schedule, gm.cost).metrics().makespan)
