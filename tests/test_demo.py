"""The main job end to end at a small size: profile, search, compare, train, report; and the
report renders in a real headless Chromium (skipped, with the reason, where there is none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.cli.main import main
from flexpipe.demo.job import DemoResult
from flexpipe.viz.png import find_chromium, screenshot


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    code = main(["demo", "--steps", "6", "-m", "4", "--out", str(out), "--width", "100"])
    assert code == 0
    return out


def test_demo_writes_report_and_costs(demo_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = (demo_dir / "report.html").read_text()
    for section in ("Schedules with the profiled costs", "Timelines on one time axis",
                    "Search: time vs memory", "predicted vs measured", "Training loss (6 steps)"):
        assert section in report
    assert (demo_dir / "cost.json").stat().st_size > 100
    assert "<script" not in report and "http://" not in report.replace(
        "http://www.w3.org/2000/svg", "")


def test_demo_loss_falls_and_winner_fits(demo_dir: Path) -> None:
    import re

    report = (demo_dir / "report.html").read_text()
    first, last = map(float, re.search(r"first ([\d.]+), last ([\d.]+)", report).groups())
    assert last < first
    assert re.search(r"<tr class=best><td class=name>found: [^<]+</td>(<td>[^<]*</td>){3}"
                     r"<td>yes</td>", report)


def test_the_story_comes_first(demo_dir: Path) -> None:
    """The report opens with what was asked and what was found, before any table."""
    report = (demo_dir / "report.html").read_text()
    story = report.index("<table class=story>")
    assert story < report.index("Schedules with the profiled costs")
    for label in ("Asked", "Found", "Memory", "Speed", "Why"):
        assert f"<th>{label}</th>" in report[story:]
    assert "75% of 1F1B&#x27;s" in report or "75% of 1F1B's" in report


@pytest.mark.skipif(find_chromium() is None, reason="Chromium is not installed (apt-get install "
                    "chromium); the report's screenshot test needs a real browser")
def test_report_renders_in_chromium(demo_dir: Path, tmp_path: Path) -> None:
    from test_viz import colours, read_png

    html = (demo_dir / "report.html").read_text()
    png = screenshot(html, tmp_path / "report.png", 1300, 2000)
    width, height, rows = read_png(png)
    assert (width, height) == (1300, 2000)
    assert len(colours(width, rows)) > 50


# --- the verdict, on made-up results (no training) --------------------------------------------

def _result(stretch: float, baseline_ms: float) -> DemoResult:
    """A demo result whose winner (ZB-H1) ran ``stretch`` times its prediction, next to a 1F1B
    measured at ``baseline_ms`` per step."""
    from flexpipe.cost.model import CostModel
    from flexpipe.demo.job import Compared, DemoConfig, winner_name
    from flexpipe.schedules.registry import build
    from flexpipe.search import search
    from flexpipe.sim import Trace, simulate

    cost = CostModel.uniform(2, 2, f=1.5, b=1.6, w=0.9, act=2.5e8, wact=1.2e8)
    found = search(cost, 2, 4, 4 * 2.5e8)
    predicted = simulate(build("zb-h1", 2, 4), cost)
    def scaled(times: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(t * stretch for t in row) for row in times)

    measured = Trace(predicted.schedule, scaled(predicted.starts), scaled(predicted.ends),
                     (predicted.memory, predicted.static_memory), source="measured")
    compared = [Compared("1f1b", simulate(build("1f1b", 2, 4), cost), True),
                Compared(winner_name(found.best), predicted, True)]
    step = predicted.metrics().makespan * stretch
    return DemoResult(DemoConfig(), cost, 4 * 2.5e8, found, compared, [5.5, 5.0, 4.5],
                      [step] * 3, predicted, measured, [baseline_ms] * 3)


def test_verdict_uses_one_ratio_and_flags_a_prediction_off_by_more_than_10_percent() -> None:
    from flexpipe.demo.verdict import explain, speedup

    held = _result(1.0, 0.0)
    base = held.compared[0].trace.metrics().makespan
    held.baseline_ms = [base] * 3
    got = speedup(held)
    assert got is not None and got.measured == pytest.approx(got.predicted)
    text = explain(held)
    assert "held (within 10%)" in text and "off" not in text.split("held")[0]
    assert "speed-up" in text.lower() and "the time of" not in text
    off = _result(1.69, base)
    text, late = explain(off), speedup(off)
    assert late is not None and "Prediction off" in text and "+69%" in text and "because" in text
    assert f"measured {late.measured:.2f}x" in text and "-41%" in text
    # every op ran 1.69x its profile and nothing else changed: the replay puts it all on them
    assert "between them for 0 ms" in text and "1.69x their profiled time" in text


def test_the_story_says_what_was_asked_found_and_how_fast() -> None:
    from flexpipe.demo.story import story

    held = _result(1.0, 0.0)
    base = held.compared[0].trace.metrics().makespan
    held.baseline_ms = [base * 0.8] * 3
    rows = dict(story(held))
    assert list(rows) == ["Asked", "Found", "Memory", "Speed", "Why"]
    assert "under 75% of 1F1B's" in rows["Asked"] and "search" not in rows["Found"]
    assert "% of the limit" in rows["Memory"] and "(1F1B: " in rows["Memory"]
    assert "x 1F1B predicted" in rows["Speed"] and "measured" in rows["Speed"]
    assert rows["Why"].count(". ") <= 2 and "held (within 10%)" in rows["Why"]
    late = dict(story(_result(1.69, base)))
    assert "off by more than 10%" in late["Why"]


@pytest.mark.parametrize("name,want", [
    ("search:policy[linear] ahead=none reserve=auto", "list scheduler, 1 stage/rank"),
    ("search:policy[vshape] builder=adaptive-v", "list scheduler, V-shape, 2 stages/rank, "
     "adaptive V for the limit"),
    ("search:policy[linear] ahead=2p-1 reserve=all", "list scheduler, 1 stage/rank, "
     "warm-up <= 2(p-r)-1, memory kept for later stages"),
    ("search:policy[interleaved] split=False", "list scheduler, interleaved stages, "
     "fused backward"),
    ("zb-h1", "ZB-H1"), ("interleaved-1f1b v=3", "interleaved-1f1b v=3"),
    ("1f1b +R[0]", "1F1B, full recompute on stage 0"),
    ("zb-h1 +SR[0-1] R[3]", "ZB-H1, selective recompute on stages 0-1, full recompute on "
     "stage 3"),
    ("zb-v +SR[0,2]", "ZB-V, selective recompute on stages 0, 2"),
    ("search:policy[linear] ahead=none +R[1]", "list scheduler, 1 stage/rank, full "
     "recompute on stage 1")])
def test_a_schedule_is_named_for_a_reader(name: str, want: str) -> None:
    from flexpipe.demo.story import readable

    assert readable(name) == want
    assert readable("search winner: " + name.removeprefix("search:")) == want


def test_the_winner_is_named_once() -> None:
    from flexpipe.demo.job import winner_name
    from flexpipe.schedules.registry import build

    name = winner_name(build("1f1b", 2, 4).renamed("search:policy[interleaved] ahead=none"))
    assert name == "search winner: policy[interleaved] ahead=none"
    assert name.count("search") == 1
