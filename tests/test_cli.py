"""The command line: every command's happy path through ``main([...])``, JSON output, exit codes
and one-line errors on bad input, the terminal timeline with and without colour, and the real
console script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_calls import call, plain_terminal  # noqa: F401 (the fixture)
from flexpipe.cli.common import parse_value
from flexpipe.cli.main import COMMANDS
from flexpipe.ir import Op, Placement, Schedule, parse_schedule
from flexpipe.ir.kinds import BUILTIN, KindRegistry, OpKind
from flexpipe.schedules.registry import build, library, names
from flexpipe.sim import Trace, simulate
from flexpipe.viz.terminal import timeline

pytestmark = pytest.mark.usefixtures("plain_terminal")


def write_schedule(tmp_path: Path, schedule: Schedule, name: str = "s.txt") -> str:
    path = tmp_path / name
    path.write_text(schedule.to_text(), encoding="utf-8")
    return str(path)


# --- list, show, simulate, export, demo ------------------------------------------------------

def test_list_names_every_library_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "list")
    assert code == 0
    for name in names():
        assert name in out
    code, out, _ = call(capsys, "list", "--names")
    assert code == 0 and out.split() == names()


@pytest.mark.parametrize("p, m", [(4, 8), (2, 3)])
def test_show_draws_one_row_per_rank_without_colour(capsys: pytest.CaptureFixture[str],
                                                    p: int, m: int) -> None:
    code, out, err = call(capsys, "show", "1f1b", "-p", str(p), "-m", str(m), "--width", "90")
    assert code == 0 and not err
    assert "\x1b[" not in out
    rows = [ln for ln in out.splitlines() if ln.startswith("rank ")]
    assert len(rows) == p
    assert all(len(row) == 90 for row in rows)
    for r, row in enumerate(rows):
        assert row.startswith(f"rank {r} |")
        for j in range(m):
            assert f"F{j}" in row and f"X{j}" in row
    assert "makespan" in out and "bubble rate" in out and "peak activation" in out


def test_show_a_schedule_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_schedule(tmp_path, build("zb-h1", 3, 4))
    code, out, _ = call(capsys, "show", path, "--width", "80")
    assert code == 0
    assert sum(ln.startswith("rank ") for ln in out.splitlines()) == 3
    assert "W3" in out
    code, _, err = call(capsys, "simulate", path, "-p", "4")
    assert code == 2 and "3 ranks, not 4" in err


def test_timeline_colours_cells_from_the_kind_registry() -> None:
    trace = simulate(build("zb-h1", 2, 2))
    text = timeline(trace, width=60, color=True)
    colours = {str(span.style.bgcolor.name) for span in text.spans  # type: ignore[union-attr]
               if not isinstance(span.style, str) and span.style.bgcolor is not None}
    assert {"blue", "green", "yellow"} <= colours
    assert text.plain.count("\n") >= 2


def _hand_trace(ops: list[Op], placement: Placement) -> Trace:
    sched = Schedule.build([ops], placement, 1)
    times = tuple(float(i) for i in range(len(ops)))
    ends = tuple(t + 1 for t in times)
    return Trace(sched, (times,), (ends,), ((((0.0, 0.0),),), (0.0,)))


def test_timeline_draws_a_new_kind_without_edits() -> None:
    registry = KindRegistry((*BUILTIN, OpKind("OPT", "optimizer step", color="red", glyph="O")))
    trace = _hand_trace([Op("F", 0, 0), Op("OPT", 0, 0)], Placement.linear(1))
    assert "O0" in timeline(trace, width=40, color=False, registry=registry).plain
    assert "optimizer step" in timeline(trace, width=40, registry=registry).plain


def test_timeline_tells_chunks_apart() -> None:
    trace = _hand_trace([Op("F", 0, 0), Op("F", 1, 0)], Placement.explicit([0, 0], 1))
    row = timeline(trace, width=40, color=False).plain.splitlines()[0]
    assert "F0" in row and "f0" in row
    shaded = timeline(trace, width=40, color=True)
    colours = {str(s.style.bgcolor) for s in shaded.spans  # type: ignore[union-attr]
               if not isinstance(s.style, str) and s.style.bgcolor is not None}
    assert len(colours) >= 2


@pytest.mark.parametrize("p, m", [(4, 8), (2, 5), (3, 3)])
def test_simulate_json(capsys: pytest.CaptureFixture[str], p: int, m: int) -> None:
    code, out, _ = call(capsys, "simulate", "1f1b", "-p", str(p), "-m", str(m), "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("makespan", "bubble_rate", "peak_activation", "schedule", "p", "m", "span",
                "busy", "peak_memory"):
        assert key in data
    assert (data["schedule"], data["p"], data["m"]) == ("1f1b", p, m)
    assert data["bubble_rate"] == pytest.approx((p - 1) / (m + p - 1))
    assert data["makespan"] == pytest.approx(3 * (m + p - 1))
    assert len(data["peak_activation"]) == p and max(data["peak_activation"]) == min(p, m)


def test_simulate_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "simulate", "gpipe", "-p", "4", "-m", "8")
    assert code == 0
    assert "bubble rate 0.2727" in out and "makespan 33" in out


def test_export_text_round_trips(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "export", "zb-h1", "-p", "3", "-m", "4")
    assert code == 0 and parse_schedule(out).to_text() == build("zb-h1", 3, 4).to_text()
    target = tmp_path / "s.txt"
    code, out, _ = call(capsys, "export", "1f1b", "-p", "2", "-m", "2", "-o", str(target))
    assert code == 0 and not out
    assert parse_schedule(target.read_text()).ranks == build("1f1b", 2, 2).ranks


def test_export_torch_csv(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "export", "1f1b", "-p", "2", "-m", "2", "--format", "torch-csv")
    assert code == 0 and out.strip()


def test_demo_compares_and_draws_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "demo", "--dry-run", "--width", "100")
    assert code == 0
    assert "1f1b" in out and "best:" in out
    rows = sum(ln.startswith("rank ") for ln in out.splitlines())
    assert rows >= 4 and rows % 4 == 0  # 4 ranks, in bands when one band would cut labels


def test_cost_file_drives_simulation_and_cost_aware_generators(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"default": {"F": 2.0, "B": 2.0, "W": 1.0}, "num_stages": 4}))
    code, out, _ = call(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--cost", str(path),
                        "--json")
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(5 * (8 + 3))
    assert json.loads(out)["cost"] == str(path)
    code, out, _ = call(capsys, "show", "1f1b", "-p", "4", "-m", "8", "--cost", str(path))
    assert code == 0 and "makespan 55" in out
    takes_cost = [n for n, e in library().items() if "cost" in dict(e.params)]
    if takes_cost:
        name = takes_cost[0]
        stages = build(name, 4, 8).num_stages
        path.write_text(json.dumps({"default": {"F": 1.0, "B": 1.5, "W": 0.5},
                                    "num_stages": stages}))
        code, out, _ = call(capsys, "simulate", name, "-p", "4", "-m", "8", "--cost", str(path),
                            "--json")
        assert code == 0 and json.loads(out)["p"] == 4


def test_list_full(capsys: pytest.CaptureFixture[str]) -> None:
    short = call(capsys, "list")[1]
    code, full, _ = call(capsys, "list", "--full")
    assert code == 0 and len(full) >= len(short)


# --- validate ---------------------------------------------------------------------------------

def test_validate_a_good_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = call(capsys, "validate", write_schedule(tmp_path, build("1f1b", 3, 4)))
    assert code == 0 and out.strip() == "valid"


def test_validate_a_broken_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = build("1f1b", 2, 2)
    rank1 = list(good.ranks[1])
    rank1[0], rank1[1] = rank1[1], rank1[0]  # 1BW0 before its forward 1F0
    path = write_schedule(tmp_path, good.with_ranks([good.ranks[0], rank1]))
    code, out, err = call(capsys, "validate", path)
    assert code == 1 and not err
    assert out.startswith("invalid") and "1BW0" in out


def test_validate_a_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "validate", "gpipe", "-p", "4", "-m", "8", "--mem", "5")
    assert code == 1 and "memory" in out and "rank 0" in out
    code, out, _ = call(capsys, "validate", "gpipe", "-p", "4", "-m", "8", "--mem", "8")
    assert code == 0 and out.strip() == "valid"


# --- errors -----------------------------------------------------------------------------------

BAD = {
    "unknown schedule": ["show", "no-such-schedule", "-p", "4", "-m", "8"],
    "missing file": ["simulate", "missing.txt"],
    "zero ranks": ["show", "1f1b", "-p", "0", "-m", "8"],
    "negative microbatches": ["simulate", "1f1b", "-p", "4", "-m", "-3"],
    "no -p": ["simulate", "1f1b", "-m", "8"],
    "bad param": ["simulate", "1f1b", "-p", "4", "-m", "8", "--param", "w"],
    "param not taken": ["simulate", "1f1b", "-p", "4", "-m", "8", "--param", "zz=1"],
    "unknown command": ["frobnicate"],
    "bad format": ["export", "1f1b", "-p", "2", "-m", "2", "--format", "png"],
    "missing cost file": ["simulate", "1f1b", "-p", "2", "-m", "2", "--cost", "nope.json"],
}


@pytest.mark.parametrize("argv", BAD.values(), ids=BAD.keys())
def test_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str],
                                         argv: list[str]) -> None:
    code, _, err = call(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0] and lines[0].startswith("flexpipe")


@pytest.mark.parametrize("text", ["garbage\n", "flexpipe-schedule v1\nranks: 2 stages: 2\n",
                                  "flexpipe-schedule v1\nranks: 1 stages: 1 microbatches: 1\n"
                                  "placement: 0\nrank 0: 0F0 0Q0\n"])
def test_malformed_schedule_file(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 text: str) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(text)
    for cmd in ("show", "simulate", "validate"):
        code, _, err = call(capsys, cmd, str(path))
        assert code == 2 and len(err.strip().splitlines()) == 1 and "line" in err


def test_bad_cost_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cost.json"
    path.write_text("{not json")
    code, _, err = call(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--cost", str(path))
    assert code == 2 and err.startswith("flexpipe: error:")


def test_help_version_and_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert call(capsys, "--version")[0] == 0
    code, out, _ = call(capsys, "--help")
    assert code == 0 and all(name in out for name in COMMANDS)
    assert call(capsys, "show", "--help")[0] == 0
    assert call(capsys)[0] == 2


def test_parse_value() -> None:
    assert [parse_value(x) for x in ("3", "0.5", "true", "none", "abc")] == [
        3, 0.5, True, None, "abc"]


# --- the installed program --------------------------------------------------------------------

def test_console_script_lists_without_importing_torch() -> None:
    script = Path(sys.executable).parent / "flexpipe"
    if not script.exists():
        pytest.skip("the flexpipe console script is not installed")
    done = subprocess.run([str(script), "list", "--names"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.split() == names()
    probe = ("import sys; from flexpipe.cli.main import main; main(['list']); "
             "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_python_dash_m() -> None:
    done = subprocess.run([sys.executable, "-m", "flexpipe", "simulate", "1f1b", "-p", "2", "-m",
                           "2", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout)["p"] == 2


# --- the gate, the guards, outputs and safe text (issue 19) -------------------------------------

def _broken(tmp_path: Path) -> Path:
    """ZB-H1 at p=2, m=4 with its last W dropped: the validator rejects it."""
    text = build("zb-h1", 2, 4).to_text().replace(" 0W3\n", "\n")
    path = tmp_path / "bad.txt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", ["simulate", "show", "export"])
def test_every_command_refuses_an_invalid_schedule(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path, command: str) -> None:
    bad = str(_broken(tmp_path))
    code, out, err = call(capsys, command, bad)
    assert code == 2 and out == ""
    assert "schedule is invalid (1 violation)" in err and "has B but no W" in err, err
    code, out, err = call(capsys, command, bad, "--no-validate")
    assert code == 0 and out and "was not validated (--no-validate)" in err, err


def test_draw_refuses_an_invalid_schedule(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    code, _, err = call(capsys, "draw", str(_broken(tmp_path)), "-o", str(tmp_path / "x.svg"))
    assert code == 2 and "schedule is invalid" in err and not (tmp_path / "x.svg").exists()


def test_size_guards_refuse_before_the_work(capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path) -> None:
    code, _, err = call(capsys, "simulate", "1f1b", "-p", "100000", "-m", "100000")
    assert code == 2 and "about 60,000,000,000 ops" in err and "--no-size-guard" in err, err
    csv = tmp_path / "m.csv"
    csv.write_text("0F999999999\n")
    code, _, err = call(capsys, "validate", str(csv))
    assert code == 2 and "1000000000 micro-batches" in err, err


def test_size_guard_follows_the_stated_memory(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXPIPE_MEMORY", "1MiB")
    code, _, err = call(capsys, "simulate", "1f1b", "-p", "4", "-m", "64")
    assert code == 2 and "1.00 MiB this machine has available" in err, err
    assert call(capsys, "simulate", "1f1b", "-p", "4", "-m", "64", "--no-size-guard")[0] == 0
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "2", "--steps", "1")
    assert code == 2 and "2 rank processes need" in err, err
    monkeypatch.delenv("FLEXPIPE_MEMORY")
    many = str(4 * (os.cpu_count() or 1) + 1)
    code, _, err = call(capsys, "run", "1f1b", "-p", many, "-m", many, "--steps", "1")
    assert code == 2 and "more than 4 per core" in err, err


def test_outputs_are_checked_before_the_work(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    code, _, err = call(capsys, "search", "-p", "2", "-m", "4", "--mem", "2", "-o",
                        "/nonexistent/x.txt")
    assert code == 2 and "folder '/nonexistent' does not exist" in err, err
    for argv, name in ((["export", "1f1b", "-p", "2", "-m", "2"], "kept.txt"),
                       (["draw", "1f1b", "-p", "2", "-m", "2"], "kept.svg")):
        kept = tmp_path / name
        kept.write_text("mine\n")
        code, _, err = call(capsys, *argv, "-o", str(kept))
        assert code == 2 and "exists; give --force" in err and kept.read_text() == "mine\n"
    assert call(capsys, "export", "1f1b", "-p", "2", "-m", "2", "-o", str(kept), "--force")[0] == 0
    assert kept.read_text().startswith("flexpipe-schedule v1")


def test_exact_keeps_the_heuristic_answer_it_cannot_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = call(capsys, "search", "-p", "4", "-m", "8", "--mem", "1.5", "--exact",
                        "--time-limit", "1", "--json")
    result = json.loads(out)
    assert code == 0 and "R" in result["schedule"]  # recompute: outside the CP-SAT model
    assert result["exact"]["status"].startswith("skipped: the exact optimiser handles")


HOSTILE_COST = {"1e308": '{"num_stages": 2, "default": {"F": 1e308, "B": 1, "W": 1}}',
                "5000 digits": '{"num_stages": 2, "default": {"F": ' + "9" * 5000 + "}}",
                "nested 1000 deep": '{"num_stages": 2, "x": ' + "[" * 1000 + "]" * 1000 + "}"}


@pytest.mark.parametrize("what", list(HOSTILE_COST))
def test_overflowing_numbers_are_refused_at_load(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path, what: str) -> None:
    path = tmp_path / "cost.json"
    path.write_text(HOSTILE_COST[what])
    code, out, err = call(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--cost", str(path),
                          "--json")
    assert code == 2 and out == "" and err.startswith(f"flexpipe: error: {path}"), err
    toml = tmp_path / "deep.toml"
    toml.write_text("a = " + "[" * 1000 + "]" * 1000 + "\n")
    code, _, err = call(capsys, "simulate", "1f1b", "-p", "2", "-m", "2", "--cost", str(toml))
    assert code == 2 and "nested too deeply" in err


def test_unicode_digits_and_hostile_names(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    text = build("1f1b", 2, 2).to_text()
    sup = tmp_path / "sup.txt"
    sup.write_text(text.replace("ranks: 2", "ranks: ²"))
    code, _, err = call(capsys, "simulate", str(sup))
    assert code == 2 and "counts must be positive integers (token '²')" in err, err
    code, _, err = call(capsys, "simulate", "1f1b", "-p", "٣", "-m", "2")
    assert code == 2 and "expected a positive integer" in err
    esc = tmp_path / "esc.txt"
    esc.write_text(text.replace("name: 1f1b", "name: \x1b[31mred"))
    code, _, err = call(capsys, "simulate", str(esc))
    assert code == 2 and "control character U+001B" in err and "\x1b" not in err
    from flexpipe.cli.guards import safe

    assert safe("\x1b[31mred\u202e") == "\\x1b[31mred\\u202e"
    marked = tmp_path / "marked.txt"
    marked.write_text(text.replace("name: 1f1b", "name: [/x] [bold]b"))
    code, out, _ = call(capsys, "simulate", str(marked))
    assert code == 0 and "[/x] [bold]b: 2 ranks" in out


def test_json_output_is_strict(capsys: pytest.CaptureFixture[str]) -> None:
    from flexpipe.cli.guards import dumps

    assert json.loads(dumps({"a": float("inf"), "b": [float("nan"), 1.5]})) == \
        {"a": None, "b": [None, 1.5]}
    code, out, _ = call(capsys, "simulate", "zb-h1", "-p", "2", "-m", "4", "--json")
    assert code == 0 and json.loads(out, parse_constant=lambda c: pytest.fail(c))["p"] == 2


def test_a_dry_run_checks_the_job_and_starts_nothing(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from flexpipe.runtime.processes import launch

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("a dry run started processes")

    monkeypatch.setattr(launch, "launch", never)
    code, out, _ = call(capsys, "run", "zb-v", "-p", "4", "-m", "8", "--dp", "2", "--dry-run",
                        "--json")
    assert code == 0
    said = json.loads(out)
    assert said["dry_run"] and said["world"] == 8 and said["schedule"] == "zb-v"
    code, _, err = call(capsys, "run", "zb-v", "-p", "2", "-m", "8", "--partition", "1,1",
                        "--dry-run")
    assert code == 2 and "partition" in err  # what a run refuses, a dry run refuses too


def test_a_dry_run_of_dualpipe_checks_out_and_refuses_what_does_not_run_yet(
        capsys: pytest.CaptureFixture[str]) -> None:
    """DualPipe's run takes 2m micro-batches (m each way); tensor parallelism is refused by
    name."""
    code, out, _ = call(capsys, "run", "dualpipe", "-p", "2", "-m", "4", "--dry-run", "--json")
    said = json.loads(out)
    assert code == 0 and said["world"] == 2 and said["global_batch_size"] == 8 * 4
    code, _, err = call(capsys, "run", "dualpipe", "-p", "2", "-m", "4", "--dry-run",
                        "--tp", "2")
    assert code == 2 and "two-way placement yet with tensor parallelism" in err, err
    assert "dualpipev" in err


def test_a_dry_run_checks_expert_parallelism(capsys: pytest.CaptureFixture[str]) -> None:
    """``--ep`` shares the built-in moe's experts out (also with ``--fsdp``, mixed precision
    and HSDP); a dry run refuses an ep that does not divide a layer's experts, a model without
    experts, and ep with tp > 1 of the moe, which has no tensor-parallel plan, naming what is
    wrong."""
    code, out, _ = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--model", "moe",
                        "--ep", "2", "--experts", "4", "--dry-run", "--json")
    said = json.loads(out)
    assert code == 0 and said["world"] == 4 and said["dry_run"]
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--model", "moe",
                        "--ep", "3", "--dry-run")
    assert code == 2 and "ep = 3 does not divide the 8 experts of '1.moe'" in err
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--ep", "2", "--dry-run")
    assert code == 2 and "the model 'gpt' has no experts to share out" in err
    moe = ("run", "1f1b", "-p", "2", "-m", "4", "--model", "moe", "--ep", "2", "--experts", "4",
           "--dry-run", "--no-size-guard")
    for more in (("--dp", "2", "--fsdp"), ("--mixed-precision", "bf16", "--fsdp"),
                 ("--dp", "2", "--fsdp", "--dp-replicate", "2")):
        code, _, err = call(capsys, *moe, *more)
        assert code == 0, (more, err)
    code, _, err = call(capsys, *moe, "--tp", "2")
    assert code == 2 and "tp = 2: the model 'moe' has no tensor-parallel plan" in err, err


def test_a_dry_run_checks_hsdp(capsys: pytest.CaptureFixture[str]) -> None:
    """``--dp 4 --fsdp --dp-replicate 2``: HSDP, 2 replica groups of 2 shards (world p x dp);
    a replica count that does not divide --dp, or HSDP of a schedule that shards nothing, is
    refused by name."""
    code, out, _ = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--dp", "4", "--fsdp",
                        "--dp-replicate", "2", "--dry-run")
    assert code == 0 and "dp=4 (HSDP 2 x 2)" in out and "8 processes" in out
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--dp", "4", "--fsdp",
                        "--dp-replicate", "3", "--dry-run")
    assert code == 2 and "--dp-replicate = 3 does not divide the 4 data-parallel ranks" in err
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--dp", "4",
                        "--dp-replicate", "2", "--dry-run")
    assert code == 2 and "--dp-replicate = 2 replicates FSDP2's shards (HSDP)" in err
    assert "gathers nothing (no AG/RS)" in err
