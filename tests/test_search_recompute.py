"""The search trades recompute for memory (``flexpipe.search.recompute``): under a tight limit on
a user model's profile the winner recomputes (SR, with the profile's measured ``sr_act``) on the
stages that need it and the output says so; under a loose limit it recomputes nothing; when
nothing fits the error names the smallest peak reached. The plan chosen for a schedule is the
cheapest that fits among every assignment of nothing, SR or R to its stages (brute force on
small cases), and the per-option peaks it is chosen by are the simulator's."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from flexpipe.cli.main import main
from flexpipe.cost.io import cost_from_dict, load_cost
from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.schedules.recompute import recompute_stages, with_recompute
from flexpipe.schedules.registry import build
from flexpipe.search import fit_cost, search
from flexpipe.search.recompute import cheapest_recompute
from flexpipe.search.recompute_plans import option_peaks, rank_options, recompute_time
from flexpipe.search.result import stage_ranges
from flexpipe.sim import simulate
from flexpipe.viz.units import fmt_memory

MIB = 2**20
P, M = 4, 8
PROFILE = {
    "description": "a profile of a user model under Recompute(drop=MLP): times in ms, memory "
                   "in bytes (sr_act, sr_act_w: what a forward marked SR keeps)",
    "num_stages": P,
    "default": {"F": 2.0, "B": 2.1, "W": 1.6, "BW": 3.6, "SR": 0.3, "act": 64 * MIB,
                "wact": 24 * MIB, "input": 4 * MIB, "sr_act": 30 * MIB,
                "sr_act_w": 38 * MIB, "out_bytes": 4 * MIB},
    "stages": [{"F": 2.4, "B": 2.5, "SR": 0.35}, {}, {}, {"F": 2.6, "B": 2.8, "act": 56 * MIB}],
    "comm": {"latency": 0.05, "bandwidth": 1e9},
}
"""Stage 0 embeds, stage 3 holds the head: uneven, as a profile of a real model is."""


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("recompute") / "profile.json"
    path.write_text(json.dumps(PROFILE))
    return path


def _cost() -> CostModel:
    return cost_from_dict(PROFILE)


def _cli(capsys: pytest.CaptureFixture[str], path: Path, mem: str,
         *extra: str) -> tuple[int, str]:
    code = main(["search", "--cost", str(path), "-p", str(P), "-m", str(M), "--mem", mem,
                 *extra])
    return code, capsys.readouterr().out


def test_tight_limit_wins_with_sr_and_says_so(profile_file: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    limit = 224 * MIB  # 3.5 M_B: ZB-V needs 4 on every rank
    result = search(_cost(), P, M, limit)
    best = result.best_trial
    assert best is not None and best.recompute is not None and best.peak is not None
    assert best.peak <= limit and {k for _, k in best.recompute.plan} == {"SR"}
    assert best.recompute.needed > limit >= best.recompute.limit
    plain = search(_cost(), P, M, limit, recompute=False).best_trial
    assert plain is not None and best.makespan < plain.makespan  # type: ignore[operator]
    code, out = _cli(capsys, profile_file, "224MiB")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("recompute:"))
    assert line == best.recompute.line(fmt_memory)
    assert line.startswith("recompute: SR on stage") and "there without it; limit 224.0 MiB)" \
        in line and line.endswith("% step time")
    code, out = _cli(capsys, profile_file, "224MiB", "--json")
    data = json.loads(out)
    assert data["recompute"]["stages"]["SR"] and data["recompute"]["line"].startswith(
        "recompute: SR")
    assert data["best"]["recompute"] == {k: v for k, v in data["recompute"].items()
                                         if k != "line"}


def test_loose_limit_recomputes_nothing(profile_file: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    result = search(_cost(), P, M, 8 * 64 * MIB)
    plain = search(_cost(), P, M, 8 * 64 * MIB, recompute=False)
    assert result.best_trial is not None and plain.best_trial is not None
    assert result.best_trial.recompute is None
    assert result.best_trial.label == plain.best_trial.label
    assert result.best_trial.makespan == plain.best_trial.makespan
    code, out = _cli(capsys, profile_file, "512MiB")
    assert code == 0 and "recompute:" not in out
    code, out = _cli(capsys, profile_file, "512MiB", "--json")
    assert json.loads(out)["recompute"] is None


def test_nothing_fits_names_the_smallest_peak(profile_file: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    result = search(_cost(), P, M, 8 * MIB)
    assert result.best is None
    least = result.least_peak
    assert least is not None and least.peak is not None and least.peak > 8 * MIB
    assert least.peak == min(t.peak for t in result.trials if t.peak is not None)
    code, out = _cli(capsys, profile_file, "8MiB")
    assert code == 1
    assert out.startswith("no candidate fits the memory limit (8.00 MiB per rank), even with "
                          f"recompute: the smallest peak reached is {fmt_memory(least.peak)} "
                          f"({least.label})\n")
    assert json.loads(_cli(capsys, profile_file, "8MiB", "--json")[1])["least_peak"][
        "peak"] == least.peak


def test_no_recompute_flag_keeps_the_plain_search(profile_file: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _cli(capsys, profile_file, "224MiB", "--no-recompute", "--all")
    assert code == 0 and "recompute:" not in out and "+SR[" not in out


def test_never_worse_than_without_recompute() -> None:
    """The shipped profile (examples/sr_profile.json) at 1F1B's peak: the plain best is ZB-V
    polished, which an unpolished recompute variant beat before the plain best was polished
    first (``search.engine``); recompute must not lose to the plain search."""
    cost = load_cost(Path(__file__).resolve().parents[1] / "examples" / "sr_profile.json")
    limit = max(simulate(build("1f1b", P, M), cost).metrics().peak_activation)
    got, plain = (search(cost, P, M, limit, recompute=rc).best_trial for rc in (True, False))
    assert got is not None and plain is not None
    assert got.makespan <= plain.makespan + 1e-9  # type: ignore[operator]


def _brute_force(sched, cost: CostModel, limits: list[float]) -> float | None:  # type: ignore[no-untyped-def]
    """The least priced recompute time over every assignment of nothing, SR or R to every
    stage with which ``sched`` fits (None: none fits)."""
    best = None
    for kinds in itertools.product((None, "SR", "R"), repeat=sched.num_stages):
        plan = {s: k for s, k in enumerate(kinds) if k is not None}
        peaks = simulate(recompute_stages(sched, plan), cost).metrics().peak_activation
        if all(v <= lim + 1e-9 for v, lim in zip(peaks, limits, strict=True)):
            extra = sched.microbatches * sum(recompute_time(cost.stage(s), k)
                                             for s, k in plan.items())
            best = extra if best is None else min(best, extra)
    return best


CASES = [("zb-v", 2, 4), ("1f1b", 4, 8), ("zb-h1", 4, 6), ("zb-h2", 2, 4)]


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_chosen_plan_is_the_cheapest_that_fits(name: str, p: int, m: int) -> None:
    sched = build(name, p, m)
    cost = fit_cost(_cost(), sched.num_stages)
    plain = simulate(sched, cost).metrics().peak_activation
    for share in (0.95, 0.8, 0.6, 0.4, 0.2, 0.05):
        limits = [share * max(plain)] * p
        want = _brute_force(sched, cost, limits)
        got = cheapest_recompute(sched, cost, limits)
        assert got is not None, (name, share)
        plan, met = got
        fits = all(v <= lim + 1e-9 for v, lim in zip(met.peak_activation, limits, strict=True))
        if want is None:
            assert not fits, (name, share)
            continue
        extra = sched.microbatches * sum(recompute_time(cost.stage(s), k) for s, k in plan)
        assert fits and extra == pytest.approx(want), (name, share, plan)


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_option_peaks_are_the_simulated_peaks(name: str, p: int, m: int) -> None:
    sched = build(name, p, m)
    cost = fit_cost(_cost(), sched.num_stages)
    options = [[o.plan for o in rank_options(cost, stages, m)]
               for stages in sched.placement.rank_stages]
    peaks = option_peaks(sched, cost, options)
    for r, plans in enumerate(options):
        for plan, peak in zip(plans, peaks[r], strict=True):
            met = simulate(recompute_stages(sched, dict(plan)), cost).metrics()
            assert peak == pytest.approx(met.peak_activation[r]), (name, r, plan)


def test_recompute_stages_on_the_named_stages_only() -> None:
    sched = build("zb-h1", 3, 4)
    got = recompute_stages(sched, {0: "SR", 2: "R"})
    kinds = {(op.kind, op.stage) for ops in got.ranks for op in ops if op.kind in ("SR", "R")}
    assert kinds == {("SR", 0), ("R", 2)}
    assert sum(op.kind == "SR" for op in got.ranks[0]) == 4
    assert with_recompute(sched, "R").ranks == recompute_stages(
        sched, dict.fromkeys(range(3), "R")).ranks
    with pytest.raises(ConfigError, match="recompute kind 'X' for stage 1"):
        recompute_stages(sched, {1: "X"})
    with pytest.raises(ConfigError, match="stage 5: the schedule has stages 0..2"):
        recompute_stages(sched, {5: "SR"})


def test_stage_ranges() -> None:
    assert stage_ranges([3, 0, 1, 2, 7]) == "0-3, 7"
    assert stage_ranges([4]) == "4"
