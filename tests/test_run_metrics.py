"""``flexpipe run``'s metrics (``flexpipe.cli.metrics``): the figures of each logged step, the
run folder's metrics.jsonl and TensorBoard events that tensorboard's own reader parses, and MFU
from the counted FLOPs of the model over a peak (``flexpipe.runtime.measurement.mfu``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexpipe.cli.metrics import METRICS_FILE, TB_FOLDER, Metrics
from flexpipe.errors import ConfigError
from flexpipe.runtime.measurement.mfu import gpu_peak, step_flops
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.lrschedule import LRSchedule
from flexpipe.runtime.processes.progress import Step


def metrics(tmp_path: Path, tensorboard: str = "auto") -> Metrics:
    train = SimpleNamespace(lr=0.01, steps=4, lr_schedule=LRSchedule(4, warmup_steps=1))
    args = argparse.Namespace(run_dir=str(tmp_path), tensorboard=tensorboard, log_every=2,
                              description="test")
    return Metrics(SimpleNamespace(train=train), args, tokens=1000, flops=2e9, peak=1e11,
                   header={"world": 2})


def steps() -> list[Step]:
    return [Step(k, 5.0 - k, 0.5, 2**20, "RSS", 4.5 if k == 3 else None) for k in range(4)]


def test_logged_steps_go_to_metrics_jsonl_with_lr_rate_and_mfu(tmp_path: Path) -> None:
    m = metrics(tmp_path, "off")
    texts = [m.step(s) for s in steps()]
    m.close()
    lines = [json.loads(x) for x in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert lines[0] == {"event": "run", "description": "test", "world": 2}
    assert [r["step"] for r in lines[1:]] == [2, 4]
    two = lines[1]
    assert (two["loss"], two["lr"], two["tokens_per_s"]) == (4.0, 0.01, 2000.0)
    assert two["tflops_per_s"] == pytest.approx(4e-3) and two["mfu"] == pytest.approx(0.04)
    assert lines[2]["val_loss"] == 4.5 and "val_loss" not in two
    assert texts[0] == "lr 0.005  MFU 4.00%" and texts[3].endswith("val loss 4.5000")
    assert m.summary() == {"mfu_median": pytest.approx(0.04), "val_loss": 4.5}
    assert not (tmp_path / TB_FOLDER).exists()


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = metrics(tmp_path, "on")
    for s in steps():
        m.step(s)
    m.close()
    events = EventAccumulator(str(tmp_path / TB_FOLDER))
    events.Reload()
    assert {"loss", "lr", "mfu", "val_loss", "tokens_per_s"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(2, 4.0), (4, 2.0)]


def test_tensorboard_on_without_the_package_names_the_extra(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match=r"flexpipe\[tensorboard\]"):
        metrics(tmp_path, "on").step(steps()[0])
    quiet = metrics(tmp_path / "auto", "auto")
    quiet.step(steps()[1])  # auto: the JSON lines only
    quiet.close()
    assert (tmp_path / "auto" / METRICS_FILE).exists()


def test_step_flops_are_counted_from_the_model() -> None:
    spec = ModelSpec("gpt", layers=2, hidden=64, heads=4, seq=32, vocab=256, micro_batch=4)
    one = step_flops(spec, 1, 1)
    assert one is not None and step_flops(spec, 4, 2) == 8 * one
    params = 2 * 12 * 64 * 64 + 2 * 256 * 64  # blocks, embedding and head: about
    assert 0.5 < one / (6 * params * 4 * 32) < 1.5  # the 6 x params x tokens rule
    assert step_flops(ModelSpec("clip"), 1, 1) is None
    assert gpu_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_peak("NVIDIA H100 PCIe") == 756e12 and gpu_peak("a toaster") is None
