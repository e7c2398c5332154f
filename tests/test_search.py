"""The automated scheduler: it never loses to a library schedule that fits, meets the zero-bubble
paper's ZB-1p/ZB-2p bubble rates with the paper's profiled times, prunes by bounds, proves small
instances optimal with CP-SAT, handles uneven stages and per-rank limits, and has a CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpipe.cli.main import main
from flexpipe.cost import CostModel
from flexpipe.cost.model import Comm, StageCost
from flexpipe.dsl.policy import Policy, policy_schedule
from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.ir.text import parse_schedule
from flexpipe.search import fit_cost, search
from flexpipe.search.exact import solve
from flexpipe.sim import simulate
from flexpipe.sim.validate import validate

# docs/facts.md, zero-bubble paper Table 9 times and Table 5 bubble rates (ZB-1p, ZB-2p).
TABLE9 = {"1.5B": (8, 24, 18.522, 18.086, 9.337, 0.601, 0.1585, 0.0433),
          "6.2B": (8, 24, 29.718, 29.444, 19.927, 0.527, 0.1323, 0.0029)}
REFERENCE = ("v-min", "v-half", "v-zb", "zb-h1", "1f1b")


def table9_cost(p: int, f: float, b: float, w: float, comm: float) -> CostModel:
    """The paper's times; M_W = M_B / 2 (the zero-bubble code's mem_f=2, mem_w=-1 convention)."""
    return CostModel.uniform(p, p, f=f, b=b, w=w, act=1.0, wact=0.5, comm=comm)


def uneven_cost(p: int) -> CostModel:
    """First stage 1.5x (embedding), last stage 2x (LM head), the rest unit."""
    def stage(k: float) -> StageCost:
        return StageCost({"F": k, "B": k, "W": k}, act=1.0, wact=1.0)

    stages = (stage(1.5),) + (stage(1.0),) * (p - 2) + (stage(2.0),)
    return CostModel(stages, Comm.uniform(p, 0.0))


@pytest.mark.parametrize("p", [4, 6, pytest.param(8, marks=pytest.mark.slow)])
def test_never_worse_than_reference_library_at_any_limit(p: int) -> None:
    """Five limits from a third of 1F1B's peak to all of it; p = 8 (12 s) is ``slow``: the
    Table 9 rows search p = 8 in CI."""
    m = 2 * p
    for sixths in range(2, 7):  # 1/3 .. 1 of 1F1B's peak (p M_B)
        limit = p * sixths / 6
        result = search(None, p, m, limit, objective="span")  # bubble rates: span
        fits = [t.bubble_rate for t in result.trials if t.family in REFERENCE
                and t.status in ("best", "slower")]
        if fits:
            assert result.best_trial is not None
            assert result.best_trial.bubble_rate <= min(fits) + 1e-12, (p, limit)
        if result.best is not None:
            assert max(simulate(result.best).metrics().peak_activation) <= limit + 1e-9


@pytest.mark.parametrize("row", sorted(TABLE9))
def test_table9_rows_meet_zb_1p_and_2p(row: str) -> None:
    p, m, f, b, w, comm, zb1, zb2 = TABLE9[row]
    cost = table9_cost(p, f, b, w, comm)
    for factor, target in ((1, zb1), (2, zb2)):
        result = search(cost, p, m, factor * p, objective="span")  # Table 5: span
        assert result.best_trial is not None
        assert result.best_trial.bubble_rate <= target + 0.002, (row, factor)
        assert result.best_trial.peak <= factor * p + 1e-9


def test_uneven_stages_beat_every_fixed_library_schedule() -> None:
    """Never worse than the library; at p M_B a synthesised schedule beats all of it (at p/2
    the squeezed V-Min pattern is the best there is among the candidates)."""
    p = 4
    for limit, strict in ((p / 2, False), (float(p), True)):
        result = search(uneven_cost(p), p, 2 * p, limit, objective="span")
        library = [t.span for t in result.trials
                   if t.family not in ("policy", "exact") and t.status in ("best", "slower")]
        assert result.best_trial is not None and result.best_trial.span is not None
        assert result.best_trial.span <= min(library) - (1e-9 if strict else -1e-9), limit


def test_per_rank_limits_are_respected() -> None:
    limits = [3.0, 3.0, 4.0, 4.0]
    result = search(uneven_cost(4), 4, 8, limits)
    assert result.best is not None
    cost = fit_cost(uneven_cost(4), result.best.num_stages)
    peaks = simulate(result.best, cost).metrics().peak_activation
    assert all(v <= lim + 1e-9 for v, lim in zip(peaks, limits, strict=True))


def test_bounds_prune_and_statuses_explain() -> None:
    result = search(None, 4, 8, 7.0, objective="span")  # ZB-H2: zero bubble, the rest pruned
    assert result.best_trial is not None and result.best_trial.label == "zb-h2"
    assert result.gap == pytest.approx(0.0, abs=1e-12)
    counts = result.counts()
    assert counts["pruned (bound)"] >= 20
    small = search(None, 4, 8, 1.5)
    reasons = {t.label: t for t in small.trials}
    assert reasons["gpipe"].status == "pruned (memory)"
    assert reasons["1f1b"].status == "pruned (memory)"
    assert any(t.status == "over memory" and "peaks at" in t.reason for t in small.trials)
    assert small.lower_bound > 0 and small.seconds > 0


def test_result_is_loadable_text_and_frontier_is_pareto(tmp_path: Path) -> None:
    result = search(None, 4, 8, 3.0)
    assert result.best is not None
    again = parse_schedule(result.best.to_text())
    assert again.ranks == result.best.ranks and validate(again) == []
    front = result.frontier
    assert front and all(a.span <= b.span and a.peak > b.peak  # type: ignore[operator]
                         for a, b in zip(front, front[1:], strict=False))
    data = result.as_dict()
    assert json.loads(json.dumps(data))["best"]["label"] == result.best_trial.label  # type: ignore[union-attr]


def test_exact_proves_tiny_instances_optimal() -> None:
    pytest.importorskip("ortools")
    for p, m, limit in ((2, 4, 2.0), (3, 4, 3.0)):
        cost = CostModel.uniform(p, p)
        report = solve(Placement.linear(p), m, cost, [limit] * p, time_limit=20)
        assert report.status == "OPTIMAL"
        assert report.schedule is not None and validate(report.schedule) == []
        met = simulate(report.schedule, cost).metrics()
        assert max(met.span) == pytest.approx(report.objective)
        assert max(met.peak_activation) <= limit + 1e-9
        heuristic = search(cost, p, m, limit)
        assert heuristic.best_trial is not None
        linear = [t.span for t in heuristic.trials if t.placement == "linear" and t.span
                  and t.status in ("best", "slower")]
        assert min(linear) >= report.objective - 1e-9  # type: ignore[operator]


def test_search_exact_step_reports_and_never_loses() -> None:
    pytest.importorskip("ortools")
    result = search(None, 2, 4, 2.0, exact=True, time_limit=10)
    assert result.exact is not None and result.exact["status"] == "OPTIMAL"
    assert result.best_trial is not None
    assert result.best_trial.span == pytest.approx(result.exact["objective"])


def test_policy_max_ahead_gives_1f1b() -> None:
    p, m = 4, 8
    policy = Policy(split=False, max_ahead=lambda r: p - r)
    met = simulate(policy_schedule(Placement.linear(p), m, policy)).metrics()
    assert met.bubble_rate == pytest.approx((p - 1) / (m + p - 1))
    assert max(met.peak_activation) == p


def test_fit_cost_chunks_and_merges() -> None:
    cost = uneven_cost(4)
    split = fit_cost(cost, 8)
    assert split.stage(0).time("F") == pytest.approx(0.75)
    assert split.stage(7).act == pytest.approx(0.5)
    merged = fit_cost(cost, 2)
    assert merged.stage(1).time("F") == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="cannot be cut"):
        fit_cost(cost, 6)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mem_limit": 0.0}, "must be a positive number"),
    ({"mem_limit": [1.0, 2.0]}, "one per rank"),
    ({"p": 0}, "p must be a positive integer"),
    ({"objective": "nope"}, "unknown objective"),
])
def test_bad_input_is_a_config_error(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"cost": None, "p": 4, "m": 8, "mem_limit": 4.0, **kwargs}
    with pytest.raises(ConfigError, match=message):
        search(**args)  # type: ignore[arg-type]


def test_cli_search_json_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "best.txt"
    assert main(["search", "-p", "4", "-m", "8", "--mem", "4", "--json", "-o", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["best"]["status"] == "best" and data["lower_bound"] > 0
    assert parse_schedule(out.read_text()).num_ranks == 4
    assert main(["simulate", str(out)]) == 0
    capsys.readouterr()
    assert main(["search", "-p", "4", "-m", "8", "--mem", "4"]) == 0
    text = capsys.readouterr().out
    assert "best:" in text and "Pareto frontier" in text


def test_cli_search_bad_limit_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", "-p", "4", "-m", "8", "--mem", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexpipe search: error:") and "positive" in err
