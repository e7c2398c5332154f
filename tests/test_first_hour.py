"""What a new user meets in the first hour: torch/torchtitan schedule names, the job file
(``--config``) and its overrides, the global batch, split points, human units, the compact
terminal view at 80 columns, and ``flexpipe run``'s live output (streamed from the ranks while
they run; kept when the run fails)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cli_calls import call, plain_terminal  # noqa: F401 (the fixture)
from flexpipe.cli.live import Live
from flexpipe.cli.model_args import split_partition, split_points_arg
from flexpipe.errors import ConfigError
from flexpipe.schedules.registry import ALIASES
from flexpipe.sim import simulate
from flexpipe.specs import load
from flexpipe.viz.terminal import compact_timeline
from flexpipe.viz.units import fmt_bytes, fmt_memory

pytestmark = pytest.mark.usefixtures("plain_terminal")


# --- names ------------------------------------------------------------------------------------

@pytest.mark.parametrize("alias, name, v", [("Interleaved1F1B", "interleaved-1f1b", 2),
                                            ("ScheduleZBVZeroBubble", "zb-v", None),
                                            ("GPipe", "gpipe", None), ("1F1B", "1f1b", None),
                                            ("LoopedBFS", "bfs", 2)])
def test_torch_names_are_aliases(alias: str, name: str, v: int | None) -> None:
    kw = {"v": v} if v else {}
    assert load(alias, 4, 8, **kw).ranks == load(name, 4, 8, **kw).ranks


def test_list_shows_aliases_and_torch_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "list")
    assert code == 0
    for needle in ("ZBVZeroBubble", "Interleaved1F1B", "torch:zbv", "torch:interleaved-zb"):
        assert needle in out
    assert len(ALIASES) >= 7


# --- job file ---------------------------------------------------------------------------------

JOB = """
[parallelism]
pipeline_parallel_degree = 4
[search]
microbatches = 8
mem = 4
"""


def test_config_sets_defaults_and_flags_override(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.toml"
    job.write_text(JOB, encoding="utf-8")
    code, out, err = call(capsys, "search", "--config", str(job), "--json")
    assert code == 0, err
    first = json.loads(out)
    assert len(first["limits"]) == 4
    code, out, err = call(capsys, "search", "--config", str(job), "-m", "6", "--mem", "2",
                          "--json")
    assert code == 0, err
    assert json.loads(out)["limits"] == [2.0] * 4


@pytest.mark.parametrize("text, message", [
    ("[parallelism]\npipeline_parallel_degre = 2\n", "did you mean"),
    ("[search]\nmemory = 4\n", "has no option --memory"),
    ("[parallelism]\npipeline_parallel_degree = -1\n", "positive"),
    ("[parallelism\n", "not valid TOML"),
])
def test_config_errors_name_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         text: str, message: str) -> None:
    job = tmp_path / "job.toml"
    job.write_text(text, encoding="utf-8")
    code, _, err = call(capsys, "search", "--config", str(job), "-p", "2", "-m", "4",
                        "--mem", "2")
    assert code == 2 and message in err and "job.toml" in err and "Traceback" not in err


def test_global_batch_sets_microbatches(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "--global-batch-size", "30",
                        "--micro-batch-size", "4")
    assert code == 2 and "not a multiple" in err
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "3", "--global-batch-size",
                        "32", "--micro-batch-size", "4", "--dp", "2")
    assert code == 2 and "-m 3 disagrees" in err and "= 4 micro-batches" in err


def test_split_points() -> None:
    assert split_points_arg("layers.1,layers.3,layers.5") == (1, 3, 5)
    assert split_partition((1, 3, 5), 6, 4) == (2, 2, 2, 2)
    assert split_partition((2,), 4, 2) == (3, 3)
    with pytest.raises(ConfigError, match="make 3 stages"):
        split_partition((1, 2), 4, 4)
    with pytest.raises(ConfigError, match="past the last block"):
        split_partition((1, 5), 4, 3)


# --- units and the compact view -----------------------------------------------------------------

def test_human_units() -> None:
    assert fmt_bytes(5.261e9) == "4.90 GiB"
    assert fmt_bytes(1.359e7) == "13.0 MiB"
    assert fmt_bytes(512) == "512 B"
    assert fmt_memory(4) == "4 M_B" and fmt_memory(2048) == "2.00 KiB"


@given(st.floats(min_value=1024, max_value=2.0**59))
def test_fmt_bytes_reads_back(n: float) -> None:
    number, unit = fmt_bytes(n).split()
    scale = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB", "PiB"].index(unit)
    assert abs(float(number) * scale - n) <= 0.005 * n
    assert 1 <= float(number) < 1024


@pytest.mark.parametrize("name, v", [("zb-v", None), ("interleaved-1f1b", 2), ("v-half", None)])
def test_compact_view_fits_80_columns_with_every_label(name: str, v: int | None) -> None:
    kw = {"v": v} if v else {}
    trace = simulate(load(name, 4, 12, **kw))
    text = compact_timeline(trace, 80, color=False).plain
    drawing = text.split("\n\n" + "F forward")[0].splitlines()  # rows and axes, not the legend
    rows = [line for line in drawing if line.startswith("rank")]
    assert all(len(line) <= 80 for line in drawing) and len(rows) >= 8
    labels = " ".join(line.split("|", 1)[1].rstrip("|") for line in rows).split()
    ops = sum(len(r) for r in trace.schedule.ranks)
    assert sum(1 for x in labels if x.strip(".")) == ops


# --- live output --------------------------------------------------------------------------------

def test_live_prints_logged_steps_and_the_last() -> None:
    from flexpipe.runtime.processes.progress import StepLog, StepReport

    out = io.StringIO()
    live = Live(total=5, tokens=1000, every=2, stream=out)
    log = StepLog(2, live.step)
    for step in range(5):
        log.add(0, StepReport(0, step, None, 0.010, 2**20))
        assert len(live.steps) == step
        log.add(1, StepReport(1, step, 5.0 - step, 0.020, 3 * 2**20))
    lines = out.getvalue().splitlines()
    assert [x.split(":")[0] for x in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "loss 4.0000" in lines[0] and "step 20.0 ms" in lines[0]
    assert "50,000 tokens/s" in lines[0] and "3.00 MiB" in lines[0]


def _progress_task(rank: int, world: int, folder: str, progress: Any = None) -> list[int]:
    """Report progress, then finish only once the launcher has seen it (a file it writes):
    progress delivered only at the end would leave the rank waiting until the timeout."""
    progress(("started", rank))
    seen = Path(folder) / f"seen-{rank}"
    while not seen.exists():
        time.sleep(0.01)
    return [rank]


def test_progress_reaches_the_launcher_while_the_ranks_run(tmp_path: Path) -> None:
    from flexpipe.runtime.processes.launch import launch_task

    seen: list[tuple[int, object]] = []

    def on_update(rank: int, item: object) -> None:
        seen.append((rank, item))
        (tmp_path / f"seen-{rank}").write_text("")

    got = launch_task(_progress_task, (str(tmp_path),), 2, timeout_s=120, on_update=on_update)
    assert got == [[0], [1]]
    assert sorted(seen) == [(0, ("started", 0)), (1, ("started", 1))]


def test_run_failure_keeps_completed_steps(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from flexpipe.runtime.processes import launch
    from flexpipe.runtime.processes.progress import StepReport

    def failing(jobs: Any, world: int, on_update: Any = None, **_: Any) -> Any:
        for step in range(2):
            for rank in range(world):
                on_update(rank, StepReport(rank, step, 5.5 if rank else None, 0.05, 2**20))
        raise launch.LaunchError("rank 1 lost (killed by signal SIGKILL)", 1)

    monkeypatch.setattr(launch, "launch", failing)
    code, out, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "2", "--steps", "5")
    assert code == 2
    assert "step 1/5: loss 5.5000" in out and "step 2/5" in out
    assert "stopped after 2 completed steps" in err and "rank 1 lost" in err
    code, out, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "2", "--steps", "5", "--json")
    report = json.loads(out)
    assert report["steps_completed"] == 2 and "rank 1 lost" in report["error"]


# --- every figure with its unit; readable timelines; plain plans; files announced -------------

def test_simulate_names_its_units_and_bubble_definition(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "simulate", "1f1b", "-p", "8", "-m", "24", "--cost",
                        "examples/my_cost.toml")
    assert code == 0 and "makespan 1736 ms" in out and "span (ms)" in out
    assert "peak activation 8 M_B" in out and "for uneven stages" in out
    code, out, _ = call(capsys, "simulate", "zb-h1", "-p", "4", "-m", "8")
    assert "makespan 27 units" in out and "unit cost, F = B = W = 1" in out
    assert "the zero-bubble paper's" in out


def test_torch_schedule_timeline_wraps_to_stay_readable(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "show", "torch:zbv", "-p", "4", "-m", "8")
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("rank")]
    assert len(rows) > 4 and all(len(line) <= 100 for line in rows)
    labels = " ".join(line.split("|", 1)[1].rstrip("|") for line in rows).split()
    assert sum(1 for x in labels if x.strip(".")) == 4 * 48  # every op's label, whole
    code, out, _ = call(capsys, "show", "1f1b", "-p", "4", "-m", "8")
    assert sum(line.startswith("rank") for line in out.splitlines()) == 4  # fits one band


def test_plan_prints_single_layer_stages_plainly() -> None:
    from flexpipe.plan.report import _span

    assert _span(13, 13, "-") == "13" and _span("block12", "block12") == "block12"
    assert _span(0, 4, "-") == "0-4" and _span("embed", "block3") == "embed..block3"


def test_search_frontier_why_names_the_printed_best(capsys: pytest.CaptureFixture[str],
                                                    tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # one table row per line
    out_file = tmp_path / "clip.txt"
    code, out, _ = call(capsys, "search", "--preset", "clip", "-p", "4", "-m", "12", "-o",
                        str(out_file))
    assert code == 0 and f"wrote {out_file}" in out
    best = out.split("best: ", 1)[1].split("span ", 1)[1].split(" ms", 1)[0]
    frontier = out.split("Pareto frontier", 1)[1].split("candidates", 1)[0]
    assert "vs best" not in frontier.replace("vs the best", "")
    whys = [line for line in frontier.splitlines() if "slower" in line]
    assert whys and all(f"vs the best ({best} ms" in line for line in whys)
    code, out, err = call(capsys, "search", "--preset", "clip", "-p", "4", "-m", "12", "-o",
                          str(out_file))
    assert code == 2 and "--force" in err
