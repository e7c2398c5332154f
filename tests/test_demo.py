"""The main job end to end at a small size: profile, search, compare, train, report; and the
report renders in a real headless Chromium (skipped, with the reason, where there is none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.cli.main import main
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
    assert re.search(r"<tr class=best><td class=name>search: [^<]+</td>(<td>[^<]*</td>){3}"
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
