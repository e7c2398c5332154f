"""The activation peak per rank the simulator predicts from the profiled M_B and M_W, against
the one a real 2-rank run measures (live tensors after every op), within 1%, for two model
families: a user's CNN with BatchNorm and residual blocks (torch.fx; 1F1B, and ZB-H1: the B/W
split, whose convolution W once kept a graph on the gradients; a segmenter with a class per
pixel, 1F1B) and a ViT of
nn.TransformerEncoderLayers (ZB-H1); exported GPT-2 and Llama are in benchmarks/hf_models.py.
The three runs share one launch (the meter counts each run's own stages), and so do the profiles
of the two models: the 2-process launch every runtime test file shares (``shared_launch``)."""

from __future__ import annotations

import pytest
import shared_launch

from flexpipe.cost.model import CostModel
from flexpipe.ir import Placement
from flexpipe.ir.lower import lower
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.sim.engine import simulate
from flexpipe.specs import load

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")

pytestmark = pytest.mark.timeout(shared_launch.TIMEOUT_S)
TOLERANCE = 0.01
"""Memory is deterministic: both figures count the same tensors. (The issue asked for 10%; a
meter that missed the outputs a stage keeps for its B when no op saved them read the ViT's
rank 0 2.2% low, which this tolerance catches.)"""


CASES = [("tiny_models:cnn_factory", "1f1b"), ("tiny_models:cnn_factory", "zb-h1"),
         ("user_models:vit_factory", "zb-h1"), ("tiny_models:seg_factory", "1f1b"),
         ("user_models:chain_factory", "zb-v"), ("user_models:normed_factory", "zb-h1")]
"""The segmenter's loss keeps its target, a class per pixel, which the batch holds anyway:
counted as an activation, one more micro-batch's target read as live on the last rank after
each backward (the last rank measured 4.9% above the prediction at m = 4 before the executor's
meter took the targets for data). The linear chain's ZB-V turn (stages 1 and 2 on rank 1)
hands over a tensor that stage 2's W holds while stage 1 still keeps it for its B (predicted
14% over before ``Edge.kept_w``). The weight-normed net's weights are computed: each one's
graph, kept from F to W, is an activation."""


def _job(factory: str, schedule: str) -> Job:
    """One step of m = 4 at 2 ranks, its activations measured."""
    return Job(load(schedule, 2, 4), ModelSpec("user", factory=factory),
               TrainConfig(steps=1, measure_memory=True))


def _profiled() -> list[tuple[ModelSpec, Placement]]:
    """Each (model, placement) the cases profile, once."""
    jobs = [_job(*case) for case in CASES]
    return list(dict.fromkeys((job.model, job.schedule.placement) for job in jobs))


shared_launch.register(2, "predict-memory",
                       lambda: shared_launch.jobs([_job(*case) for case in CASES], 2))
shared_launch.register(2, "predict-memory-profiles",
                       lambda: shared_launch.profiles(_profiled(), reps=1))


@pytest.fixture(scope="module")
def costs() -> dict[tuple[ModelSpec, Placement], CostModel]:
    """The profiled cost model of each (model, placement), from the shared 2-rank launch."""
    keys = _profiled()
    models = shared_launch.cost_models(2, "predict-memory-profiles", [pl for _, pl in keys])
    return dict(zip(keys, models, strict=True))


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, str], list[float]]:
    """Every case's measured activation peak per rank, from the shared 2-rank launch."""
    results = shared_launch.job_results(2, "predict-memory")
    return {case: measured_trace(_job(*case).schedule, ranks).metrics().peak_activation
            for case, ranks in zip(CASES, results, strict=True)}


def peaks(factory: str, schedule: str, measured: dict[tuple[str, str], list[float]],
          costs: dict[tuple[ModelSpec, Placement], CostModel]) -> list[tuple[float, float]]:
    """(predicted, measured) activation peak of each rank."""
    job = _job(factory, schedule)
    cost = costs[(job.model, job.schedule.placement)]
    predicted = simulate(lower(job.schedule), cost).metrics().peak_activation
    return list(zip(predicted, measured[(factory, schedule)], strict=True))


@pytest.mark.parametrize(("factory", "schedule"), CASES)
def test_predicted_activation_peak_within_one_percent(
        factory: str, schedule: str, measured: dict[tuple[str, str], list[float]],
        costs: dict[tuple[ModelSpec, Placement], CostModel]) -> None:
    for rank, (want, got) in enumerate(peaks(factory, schedule, measured, costs)):
        assert got > 0, (factory, schedule, rank)
        assert abs(want - got) / got <= TOLERANCE, (factory, schedule, rank, want, got)
