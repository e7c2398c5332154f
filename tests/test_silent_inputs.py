"""Inputs that used to be accepted silently are refused with the file, the key and the reason
(issue #28): duplicate JSON keys, wrongly typed job-file values and ``--param`` values, two
outputs naming one file, ``--cost-out`` with nothing to write, bad timeouts, and planner work
too long to wait for without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpipe.cli.main import main
from flexpipe.cost.checks import read_data
from flexpipe.errors import ConfigError


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """Run ``flexpipe argv``: exit 2, one error line holding every word, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for word in words:
        assert word in err, err
    return err


@pytest.mark.parametrize("text", ['{"F": -1, "F": 1}', '{"a": {"F": 1, "B": 2, "F": 3}}',
                                  '[{"x": 1}, {"y": 1, "y": 1}]'])
def test_duplicate_json_keys_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="key '(F|y)' is given twice"):
        read_data(text, ".json", "c.json")
    assert read_data('{"F": 1, "B": 1}', ".json", "c.json") == {"F": 1, "B": 1}


def test_a_cost_file_with_a_duplicate_key(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "dup.json"
    cost.write_text('{"num_stages": 2, "num_ranks": 2, "default": {"F": -1, "F": 1}}')
    _fails(["simulate", "1f1b", "-p", "2", "-m", "4", "--cost", str(cost)], capsys,
           "dup.json", "'F'", "twice")


@pytest.mark.parametrize(("body", "words"), [
    ("[run]\ncheckpoint-dir = 5\n", ("run.checkpoint-dir", "expected a string", "integer")),
    ("[model]\nname = [\"gpt\"]\n", ("model.name", "expected a string", "array")),
    ("[run]\ntimeout = -1\n", ("run.timeout", "positive")),
    ("[run]\ntimeout = \"5\"\n", ("run.timeout", "expected an integer or a number")),
    ("[training]\nsteps = 2.5\n", ("training.steps", "expected an integer")),
    ("[training]\nseed = true\n", ("training.seed", "boolean")),
    ("[model]\nhidden = [64]\n", ("model.hidden", "expected an integer", "array")),
    ("[run]\nlr = \"0.1\"\n", ("run.lr", "expected an integer or a number", "string")),
    ("[run]\ntrace-out = {a = 1}\n", ("run.trace-out", "table")),
])
def test_job_file_values_of_the_wrong_type_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str,
        words: tuple[str, ...]) -> None:
    job = tmp_path / "job.toml"
    job.write_text(body)
    _fails(["run", "1f1b", "-p", "2", "--config", str(job)], capsys, "job.toml", *words)


def test_job_file_lists_where_a_list_is_an_option(tmp_path: Path) -> None:
    from flexpipe.cli.config import _check_type
    from flexpipe.cli.main import build_parser

    parser = build_parser("run")
    sub = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr,index]
    actions = {a.dest: a for a in sub._actions}
    _check_type("j.toml", "parallelism.pipeline_parallel_split_points", actions["split_points"],
                ["layers.2"])
    _check_type("j.toml", "parallelism.pipeline_parallel_layers_per_stage",
                actions["partition"], [2, 2, 2])
    _check_type("j.toml", "run.param", actions["param"], ["w=2"])
    with pytest.raises(ConfigError, match="run.steps: expected an integer"):
        _check_type("j.toml", "run.steps", actions["steps"], [2])


@pytest.mark.parametrize(("schedule", "param", "words"), [
    ("1f1b-recompute", "selective=maybe", ("selective", "true or false", "'maybe'")),
    ("1f1b-recompute", "selective=1", ("selective", "true or false")),
    ("interleaved-1f1b", "v=2.5", ("v", "an integer")),
    ("hanayo", "w=true", ("w", "an integer", "bool")),
])
def test_param_values_of_the_wrong_type_are_refused(
        capsys: pytest.CaptureFixture[str], schedule: str, param: str,
        words: tuple[str, ...]) -> None:
    _fails(["simulate", schedule, "-p", "2", "-m", "4", "--param", param], capsys, *words)


def test_param_values_of_the_right_type_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "1f1b-recompute", "-p", "2", "-m", "4", "--param",
                 "selective=true"]) == 0
    assert main(["simulate", "interleaved-1f1b", "-p", "2", "-m", "4", "--param", "v=2"]) == 0


def test_two_outputs_naming_one_file_are_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "x"
    _fails(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:4", "-o", str(out),
            "--cost-out", str(tmp_path / "." / "x")], capsys, "-o and --cost-out", "both name")
    assert not out.exists()
    _fails(["run", "1f1b", "-p", "2", "--predict", "--cost-out", str(out), "--trace-out",
            str(out)], capsys, "--cost-out and --trace-out")


def test_cost_out_without_predict_is_refused(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["run", "1f1b", "-p", "2", "--cost-out", str(tmp_path / "c.json")], capsys,
           "--cost-out", "--predict")


@pytest.mark.parametrize("flag", [["--timeout", "-1"], ["--timeout", "0"], ["--timeout", "nan"],
                                  ["--lr", "nan"], ["--lr", "-0.1"], ["--lr", "inf"]])
def test_bad_numbers_are_refused_before_any_rank_starts(
        capsys: pytest.CaptureFixture[str], flag: list[str]) -> None:
    _fails(["run", "1f1b", "-p", "2", *flag], capsys, flag[0], "positive")


def test_planning_too_many_devices_is_refused_up_front(
        capsys: pytest.CaptureFixture[str]) -> None:
    err = _fails(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:1024"], capsys,
                 "1024 devices", "minutes", "--no-size-guard")
    assert "planning" not in err  # refused before the planner started


def test_an_output_over_an_input_file_is_refused(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model.json"
    model.write_text(Path("examples/model.json").read_text() if Path(
        "examples/model.json").exists() else "{}")
    before = model.read_text()
    _fails(["plan", "--model", str(model), "--cluster", "nodes:4", "--cost-out", str(model),
            "--force"], capsys, "--model and --cost-out", "replace the input")
    assert model.read_text() == before


def test_a_huge_preset_cluster_is_refused_before_it_is_built(
        capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:100000"], capsys,
           "100000 devices", "--no-size-guard")
    _fails(["plan", "--model", "gpt-1.3b", "--cluster", "nodes:99999999999"], capsys,
           "TOPOLOGY:N")


@pytest.mark.parametrize("flags", [["--checkpoint-dir", ""], ["--checkpoint-dir", "  "],
                                   ["--seed", "99999999999999999999"], ["--seed", "-1"],
                                   ["--seed", "1.5"]])
def test_run_refuses_an_empty_checkpoint_dir_and_a_seed_out_of_range(
        capsys: pytest.CaptureFixture[str], flags: list[str]) -> None:
    _fails(["run", "1f1b", "-p", "2", "-m", "2", *flags], capsys, flags[0])
