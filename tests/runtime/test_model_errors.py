"""``flexpipe run --model package.module:function`` refuses, on one ``flexpipe: error:`` line
before any process starts, what does not fit a model of your own: a factory whose own code
raises (its error named, kept as the cause), ``--split-points`` (which cuts the built-in
models' blocks) and ``--partition`` (layers per stage of a chain) on a traced model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_calls import call  # noqa: E402


@pytest.mark.parametrize(("args", "words"), [
    (["--model", "user_models:failing_factory"],
     ["failing_factory() raised RuntimeError: the dataset folder is empty"]),
    (["--model", "tiny_models:cnn_factory", "--split-points", "2"],
     ["--split-points cuts the built-in models", "split_points=("]),
    (["--model", "user_models:auto_skip_factory", "--partition", "3,3"],
     ["a partition (layers per stage, --partition) cuts a chain of layers",
      "the model (SkipNet) is not one"]),
])
def test_what_does_not_fit_a_model_of_your_own_is_refused_by_name(
        capsys: pytest.CaptureFixture[str], args: list[str], words: list[str]) -> None:
    code, _, err = call(capsys, "run", "1f1b", "-p", "2", "-m", "4", "--steps", "1", *args)
    assert code == 2, err
    assert err.startswith("flexpipe: error:") and "Traceback" not in err, err
    for word in words:
        assert word in err, err
