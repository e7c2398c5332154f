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
    assert re.search(r"<tr class=best><td class=name>search winner: [^<]+</td>(<td>[^<]*</td>){3}"
                     r"<td>yes</td>", report)


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


def test_the_winner_is_named_once() -> None:
    from flexpipe.demo.job import winner_name
    from flexpipe.schedules.registry import build

    name = winner_name(build("1f1b", 2, 4).renamed("search:policy[interleaved] ahead=none"))
    assert name == "search winner: policy[interleaved] ahead=none"
    assert name.count("search") == 1
