"""The activation peak per rank the simulator predicts from the profiled M_B and M_W, against
the one a real 2-rank run measures (live tensors after every op), within 10%, for two model
families: a user's CNN with BatchNorm and residual blocks (torch.fx; 1F1B, and ZB-H1: the B/W
split, whose convolution W once kept a graph on the gradients) and a ViT of
nn.TransformerEncoderLayers (ZB-H1); exported GPT-2 and Llama are in benchmarks/hf_models.py."""

from __future__ import annotations

import pytest

from flexpipe.ir.lower import lower
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.measurement.profile import profile
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.sim.engine import simulate
from flexpipe.specs import load

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")

TOLERANCE = 0.10


def peaks(factory: str, schedule: str) -> list[tuple[float, float]]:
    """(predicted, measured) activation peak of each rank, one step of m = 4."""
    sched = load(schedule, 2, 4)
    spec = ModelSpec("user", factory=factory)
    job = Job(sched, spec, TrainConfig(steps=1, measure_memory=True))
    cost = profile(spec, sched.placement, reps=1)
    predicted = simulate(lower(sched), cost).metrics().peak_activation
    measured = measured_trace(sched, launch([job], world=2)[0]).metrics().peak_activation
    return list(zip(predicted, measured, strict=True))


@pytest.mark.parametrize(("factory", "schedule"), [("tiny_models:cnn_factory", "1f1b"),
                                                   ("tiny_models:cnn_factory", "zb-h1"),
                                                   ("user_models:vit_factory", "zb-h1")])
def test_predicted_activation_peak_within_ten_percent(factory: str, schedule: str) -> None:
    for rank, (want, got) in enumerate(peaks(factory, schedule)):
        assert got > 0, (factory, schedule, rank)
        assert abs(want - got) / got <= TOLERANCE, (factory, schedule, rank, want, got)
