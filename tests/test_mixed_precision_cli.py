"""``flexpipe run --mixed-precision bf16`` and torchtitan's job-file keys
``training.mixed_precision_param`` / ``training.mixed_precision_reduce``: they reach the run's
policy (``TrainConfig.mixed_precision``), a value neither takes is refused naming the key, and
a model built in another dtype than float32 is refused (the masters are float32)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from flexpipe.cli import config, run_args
from flexpipe.cli.main import _subparser, build_parser
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.precision import BF16, MixedPrecision


def _parse(argv: list[str], job: Path | None = None) -> argparse.Namespace:
    parser = build_parser("run")
    if job is not None:
        config.apply(_subparser(parser, "run"), "run", str(job))
    return parser.parse_args(["run", "1f1b", "-p", "2", *argv])


def test_the_flag_gives_the_policy() -> None:
    assert run_args.mixed_precision(_parse(["--mixed-precision", "bf16"])) == BF16
    assert run_args.mixed_precision(_parse([])) is None
    assert run_args.mixed_precision(_parse(["--mixed-precision", "fp32"])) is None
    low = _parse(["--mixed-precision", "bf16", "--mixed-precision-reduce", "bf16"])
    assert run_args.mixed_precision(low) == MixedPrecision(reduce_dtype=torch.bfloat16)


def test_torchtitan_keys_set_it(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[training]\nmixed_precision_param = "bfloat16"\n'
                   'mixed_precision_reduce = "float32"\n', encoding="utf-8")
    args = _parse([], job)
    assert (args.mixed_precision, args.mixed_precision_reduce) == ("bfloat16", "float32")
    assert run_args.mixed_precision(args) == BF16
    assert _parse(["--mixed-precision", "fp32"], job).mixed_precision == "fp32"  # flag wins


def test_a_bad_value_names_the_key(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text('[training]\nmixed_precision_param = "float16"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"training.mixed_precision_param: 'float16' is not "
                                          r"one of bf16, bfloat16, fp32, float32"):
        _parse([], job)


def test_masters_must_be_float32() -> None:
    args = _parse(["--mixed-precision", "bf16", "--dtype", "bfloat16"])
    with pytest.raises(ConfigError, match="--dtype bfloat16 would build the model in another"):
        run_args.mixed_precision(args)
