"""Exported models follow their stages to another device: ``torch.export`` bakes the CPU into
the tensors a model creates (positions, causal masks, dtype casts), and ``TracedStage``
rewrites its graphs for the device it computes on before the first forward there. CI has no
GPU, so the stages go to the ``meta`` device, where a tensor left on the CPU fails the same
way it would meet a CUDA tensor (measured on a GPU in docs/results.md)."""

from __future__ import annotations

import matrix_models as mm
import pytest
import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.user.devices import retarget
from flexpipe.runtime.user.interface import order_inputs
from flexpipe.runtime.user.model import cut_model
from flexpipe.runtime.user.traced_stage import TracedStage

EXPORTED = ("gpt2-tied", "llama", "qwen2-tied", "bert-mask", "t5-shared", "vit", "mixtral")


def _stages_on_meta(name: str, stages: int) -> dict[str, tuple[torch.Tensor, ...]]:
    entry = mm.MODELS[name]
    torch.manual_seed(0)
    example, _ = mm.split_batch(entry, entry.data(0, 2))
    segments, interface = cut_model(entry.build(stages), entry.points(stages), example)
    outs: dict[str, tuple[torch.Tensor, ...]] = {}
    first = tuple(t.to("meta") for t in order_inputs(interface, example))
    for seg in segments:
        stage = seg.layers[0].to("meta")
        flat = first if not seg.after else tuple(t for p in seg.after for t in outs[p])
        outs[seg.name] = stage(*flat)
    return outs


@pytest.mark.parametrize("name", EXPORTED)
def test_exported_stages_run_where_they_are_moved(name: str) -> None:
    outs = _stages_on_meta(name, 2)
    assert {t.device.type for o in outs.values() for t in o} == {"meta"}


def test_without_the_rewrite_the_baked_cpu_breaks(monkeypatch: pytest.MonkeyPatch) -> None:
    import flexpipe.runtime.user.traced_stage as traced_stage

    monkeypatch.setattr(traced_stage, "retarget", lambda module, device: 0)
    with pytest.raises((NotImplementedError, RuntimeError)):
        _stages_on_meta("llama", 2)
    assert torch.is_grad_enabled()  # the graph failed inside its own no_grad block


def test_retarget_rewrites_each_device_once() -> None:
    entry = mm.MODELS["gpt2-tied"]
    example, _ = mm.split_batch(entry, entry.data(0, 2))
    segments, _ = cut_model(entry.build(2), entry.points(2), example)
    stage = segments[0].layers[0]
    assert isinstance(stage, TracedStage)
    assert retarget(stage.piece, torch.device("cpu")) == 0  # already there: nothing to change
    moved = retarget(stage.piece, torch.device("cuda", 0))  # rewriting needs no GPU
    assert moved > 0
    assert retarget(stage.piece, torch.device("cuda", 0)) == 0
    assert retarget(stage.piece, torch.device("cpu")) == moved  # and back


def test_a_model_without_split_points_is_one_stage() -> None:
    entry = mm.MODELS["llama"]
    example, _ = mm.split_batch(entry, entry.data(0, 2))
    segments, _ = cut_model(entry.build(2), (), example)
    assert len(segments) == 1
    with pytest.raises(ConfigError, match="give split points"):
        cut_model(entry.build(2), (), example, stages=2)
