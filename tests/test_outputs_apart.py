"""No command's output may be one of its inputs (or another of its outputs), whatever the path
says: the same name, a symbolic link, a hard link, a detour through ``..``; refused before any
work, ``--force`` or not. And a job file may not set one option twice to different values."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cli_calls import call
from flexpipe.cli.config import apply
from flexpipe.errors import ConfigError

COST = '{"num_stages": 2, "num_ranks": 2, "default": {"F": 1, "B": 2, "W": 1}}\n'


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder holding a cost file, a schedule file, a job file, links to them and a
    sub-folder, as the current directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text(COST)
    (tmp_path / "sched.txt").write_text("")
    (tmp_path / "job.toml").write_text("[search]\nmem = 4\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "c.json")
    os.link(tmp_path / "c.json", tmp_path / "hard.json")
    return tmp_path


def _export(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = call(capsys, "export", "1f1b", "-p", "2", "-m", "4", "-o", "sched.txt",
                        "--force")
    assert code == 0, err


CASES = {
    "search -o its --cost through a link": (
        ["search", "--cost", "c.json", "-p", "2", "-m", "4", "--mem", "4", "-o", "link.json",
         "--force"], "--cost and -o both name 'link.json'"),
    "search -o its --cost by a hard link": (
        ["search", "--cost", "link.json", "-p", "2", "-m", "4", "--mem", "4", "-o",
         "hard.json"], "--cost and -o both name 'hard.json'"),
    "search -o its --config": (
        ["search", "--config", "job.toml", "-p", "2", "-m", "4", "-o", "job.toml", "--force"],
        "--config and -o both name 'job.toml'"),
    "export -o its schedule file": (
        ["export", "sched.txt", "-o", "./sub/../sched.txt", "--force"],
        "the schedule and -o both name './sub/../sched.txt'"),
    "draw -o a schedule it compares": (
        ["draw", "1f1b", "sched.txt", "-p", "2", "-m", "4", "-o", "sched.txt", "--force"],
        "the schedule and -o both name 'sched.txt'"),
    "draw -o its --cost": (
        ["draw", "1f1b", "-p", "2", "-m", "4", "--cost", "c.json", "-o", "hard.json",
         "--force"], "--cost and -o both name 'hard.json'"),
    "plan --cost-out its --config": (
        ["plan", "--model", "gpt-1.3b", "--cluster", "nodes:2", "--config", "job.toml",
         "--cost-out", "job.toml", "--force"], "--config and --cost-out both name"),
    "run --trace-out its schedule file": (
        ["run", "sched.txt", "-p", "2", "--trace-out", "sched.txt"],
        "the schedule and --trace-out both name 'sched.txt'"),
    "run --trace-out its model's module": (
        ["run", "1f1b", "-p", "2", "-m", "2", "--model", "mine:build", "--trace-out",
         "mine.py"], "--model and --trace-out both name 'mine.py'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_output_that_is_an_input_is_refused_before_any_work(
        folder: Path, capsys: pytest.CaptureFixture[str], case: str) -> None:
    _export(capsys)
    (folder / "mine.py").write_text("raise SystemExit('imported')\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    argv, words = CASES[case]
    code, out, err = call(capsys, *argv)
    assert code == 2 and words in err and "would replace the input file" in err, (case, err)
    after = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert after == before, case  # nothing written, nothing replaced
    assert "wrote" not in out


def test_two_outputs_naming_one_file_by_a_link_are_refused(
        folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (folder / "out.txt").write_text("old")
    (folder / "alias.txt").symlink_to(folder / "out.txt")
    code, _, err = call(capsys, "plan", "--model", "gpt-1.3b", "--cluster", "nodes:2", "-o",
                        "out.txt", "--cost-out", "alias.txt", "--force")
    assert code == 2 and "-o and --cost-out both name 'alias.txt'" in err, err
    assert "replace the first file" in err and (folder / "out.txt").read_text() == "old"


def test_an_output_beside_its_inputs_is_written(folder: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = call(capsys, "search", "--cost", "link.json", "-p", "2", "-m", "4",
                          "--mem", "4", "-o", "best.txt")
    assert code == 0 and "wrote best.txt" in out, err
    assert (folder / "c.json").read_text() == COST


# --- one option, two tables --------------------------------------------------------------------

TWICE = [
    ("search", "[parallelism]\npipeline_parallel_degree = 2\n[search]\nranks = 4\n",
     "parallelism.pipeline_parallel_degree = 2 and search.ranks = 4 both set --ranks"),
    ("run", "[model]\nhidden = 16\n[run]\nhidden = 32\n",
     "model.hidden = 16 and run.hidden = 32 both set --hidden"),
    ("run", "[model]\nname = \"mlp\"\n[run]\nmodel = \"gpt\"\n",
     "model.name = 'mlp' and run.model = 'gpt' both set --model"),
    ("plan", "[parallelism]\ntensor_parallel_degree = 1\n[plan]\ntp = 2\n",
     "parallelism.tensor_parallel_degree = 1 and plan.tp = 2 both set --tp"),
]


@pytest.mark.parametrize(("command", "text", "words"), TWICE)
def test_one_option_set_twice_differently_names_both_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, text: str,
        words: str) -> None:
    job = tmp_path / "j.toml"
    job.write_text(text)
    argv = {"search": ["search", "-m", "4", "--mem", "4"],
            "run": ["run", "1f1b", "-p", "2", "-m", "2"],
            "plan": ["plan", "--model", "gpt-1.3b", "--cluster", "nodes:2"]}[command]
    code, _, err = call(capsys, *argv, "--config", str(job))
    assert code == 2 and f"{job}: {words}" in err and "keep one of them" in err, err


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**40), st.integers(0, 2**40), st.sampled_from(["run", "search"]))
def test_a_key_twice_is_refused_exactly_when_the_values_differ(
        first: int, second: int, table: str) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "j.toml"
        job.write_text(f"[training]\nseed = {first}\n[{table}]\nseed = {second}\n")
        if first == second or table != "run":  # another command's table is not read
            apply(parser, "run", str(job))
            assert parser.parse_args([]).seed == (second if table == "run" else first)
        else:
            with pytest.raises(ConfigError, match="training.seed .* and run.seed .* both set"):
                apply(parser, "run", str(job))
