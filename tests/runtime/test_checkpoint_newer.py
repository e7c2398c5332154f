"""A checkpoint this FlexPipe cannot read is never overwritten or pruned: with a step folder
whose manifest has a newer format (the only one, or newer or older than the readable ones),
resuming refuses, naming the folder and both formats, instead of starting from scratch or from
an older checkpoint; pruning after a new checkpoint keeps such a folder. A manifest of an
older or unknown format (not a number) is only skipped, as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import build_stages
from flexpipe.runtime.models.kinds import build_model
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes import saved
from flexpipe.runtime.processes.train import TrainConfig, make_optimizer

TINY = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)


def _stages() -> tuple[dict, torch.optim.Optimizer, dict]:  # type: ignore[type-arg]
    torch.manual_seed(0)
    layers, _ = build_model(TINY)
    stages = build_stages(layers, None, 2)
    opt = make_optimizer([p for s in stages.values() for p in s.parameters()],
                         TrainConfig(optimizer="adamw"))
    return stages, opt, ck.describe(TINY, "adamw")


LAYOUT = {"pp": 2, "dp": 1, "tp": 1, "stages": 2}


def _write(root: Path, step: int, fmt: object | None = None) -> Path:
    stages, opt, meta = _stages()
    folder = ck.save(root, step, stages, opt, meta=meta, layout=LAYOUT)
    if fmt is not None:
        body = json.loads((folder / saved.MANIFEST).read_text())
        (folder / saved.MANIFEST).write_text(json.dumps({**body, "format": fmt}))
    return folder


@pytest.mark.parametrize("others", [(), (1,), (1, 9)])
def test_a_newer_format_is_refused_never_skipped(tmp_path: Path, others: tuple[int, ...]) -> None:
    for step in others:
        _write(tmp_path, step)
    newer = _write(tmp_path, 5, fmt=saved.FORMAT + 3)
    stages, opt, meta = _stages()
    resumer = ck.Checkpointer(tmp_path, 1, 20, 0, meta, 30.0, LAYOUT)
    with pytest.raises(ConfigError) as info:
        resumer.resume(stages, opt)
    text = str(info.value)
    assert f"checkpoint {newer} has manifest format {saved.FORMAT + 3}" in text, text
    assert f"reads formats up to {saved.FORMAT} (DCP)" in text and "--checkpoint-dir" in text, \
        text
    assert (newer / saved.MANIFEST).is_file() and (newer / "__0_0.distcp").is_file()


def test_pruning_keeps_a_newer_format_folder(tmp_path: Path) -> None:
    newer = _write(tmp_path, 1, fmt=saved.FORMAT + 1)
    for step in (2, 3, 4):
        _write(tmp_path, step)  # KEEP = 2: step 2 is pruned, the unreadable step 1 kept
    assert newer.is_dir() and (newer / "__0_0.distcp").is_file()
    assert not ck.step_dir(tmp_path, 2).exists()


@pytest.mark.parametrize("fmt", [saved.FORMAT - 1, "3", None, True])
def test_an_older_or_odd_format_is_only_skipped(tmp_path: Path, fmt: object) -> None:
    _write(tmp_path, 1)
    folder = _write(tmp_path, 2, fmt=fmt if fmt is not None else [])
    found, skipped = ck.find(tmp_path)
    assert found is not None and found.step == 1
    assert len(skipped) == 1 and str(folder) in skipped[0] and "format" in skipped[0], skipped
