"""Every library schedule, run for real over gloo at 2 and 4 ranks, trains exactly like one
device: same loss, same gradient of every parameter (first step), same parameters after three
optimizer steps (zeropp with its FSDP gathers and reduce-scatters, 1F1B with selective
recompute included). One launch per rank count runs every schedule in turn (fast; the launch
that every runtime test file of that many ranks shares, ``shared_launch``); the two-stream
MLP checks boundaries of several tensors (one of them integer) and data parallelism (p=2 x 2
replicas, zeropp sharding its stages over the 2 replicas) rides along in the 4-process
launch. DualPipe takes m micro-batches each way, so 2m in all (``data_microbatches``)."""

from __future__ import annotations

from functools import cache

import pytest
import shared_launch
import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.handlers import check_supported
from flexpipe.runtime.measurement.balance import auto_partition
from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import Reference, reference_run
from flexpipe.runtime.processes.train import Job, RankResult, TrainConfig
from flexpipe.schedules import registry
from flexpipe.schedules.dualpipe_twoway import data_microbatches

pytestmark = pytest.mark.timeout(shared_launch.TIMEOUT_S)
RTOL = 1e-5
GPT = ModelSpec("gpt", layers=6, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2,
                dtype="float64")
MLP = ModelSpec("mlp", layers=6, hidden=8, vocab=5, micro_batch=3, dtype="float64")
TRAIN = TrainConfig(steps=3, capture=True, timeout_s=60)
MLP_SCHEDULES = ("1f1b", "zb-v", "interleaved-1f1b")
DP_SCHEDULES = ("1f1b", "zb-h1", "zeropp")


def schedule(name: str, p: int, m: int):  # noqa: ANN201
    """Library schedule ``name`` with v=2 where it takes chunks."""
    params = dict(registry.library()[name].params)
    return registry.build(name, p, m, **({"v": 2} if "v" in params else {}))


def supported(name: str, p: int) -> bool:
    """Whether the runtime has a handler for every op kind of the schedule."""
    try:
        check_supported(schedule(name, p, 2 * p))
    except ConfigError:
        return False
    return True


@cache
def _jobs(p: int) -> dict[tuple[str, str, int], Job]:
    m = 2 * p
    jobs = {("gpt", n, 1): Job(schedule(n, p, m), GPT, TRAIN)
            for n in registry.names() if supported(n, p)}
    jobs |= {("mlp", n, 1): Job(schedule(n, p, m), MLP, TRAIN) for n in MLP_SCHEDULES}
    selective = registry.build("1f1b-recompute", p, m, selective=True)
    jobs[("gpt", "1f1b-recompute[selective]", 1)] = Job(selective, GPT, TRAIN)
    zbv = schedule("zb-v", p, m)
    jobs[("gpt", "zb-v[auto]", 1)] = Job(zbv, GPT, TRAIN,
                                         auto_partition(GPT, zbv.placement.stage_rank))
    if p == 4:  # 2 pipeline ranks x 2 data-parallel replicas on the same 4 processes
        dp = TrainConfig(steps=3, capture=True, dp=2)
        jobs |= {("gpt", n, 2): Job(schedule(n, 2, 4), GPT, dp) for n in DP_SCHEDULES}
    return jobs


for _p in (2, 4):
    shared_launch.register(_p, "equivalence",
                           lambda p=_p: shared_launch.jobs(_jobs(p).values(), p))


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def runs(request: pytest.FixtureRequest) -> tuple[int, dict[tuple[str, str, int], list]]:
    """The jobs of each rank count, in the shared launch of that many processes; results by
    (model, schedule, replicas)."""
    p = request.param
    results = shared_launch.job_results(p, "equivalence")
    return p, dict(zip(_jobs(p), results, strict=True))


REFS: dict[tuple[str, int, int], Reference] = {}


def reference(model: ModelSpec, m: int, dp: int) -> Reference:
    """Single-device run, cached."""
    key = (model.name, m, dp)
    if key not in REFS:
        train = TrainConfig(steps=3, capture=True, dp=dp)
        REFS[key] = reference_run(model, train, m)
    return REFS[key]


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    name, err = worst_relative_error(got, want)
    assert err <= RTOL, f"{what} {name}: relative diff {err:.3g}"


def _check(ranks: list[RankResult], model: ModelSpec, m: int, dp: int) -> None:
    ref = reference(model, m, dp)
    losses = [r.losses for r in ranks if r.losses[0] is not None]
    assert losses, "no rank reported a loss"
    for got in losses:
        assert got == pytest.approx(ref.losses, rel=RTOL)
    _close(by_name(ranks, "grads"), ref.grads, "gradient")
    _close(by_name(ranks, "params"), ref.params, "parameter after 3 steps")


@pytest.mark.parametrize("name", registry.names())
def test_schedule_matches_single_device(runs, name: str) -> None:  # noqa: ANN001
    p, results = runs
    if ("gpt", name, 1) not in results:
        with pytest.raises(ConfigError, match="no handler for op kind|two-way placement"):
            check_supported(schedule(name, p, 2 * p))
        pytest.skip(f"{name} uses op kinds or a placement the runtime does not run")
    _check(results[("gpt", name, 1)], GPT, data_microbatches(schedule(name, p, 2 * p)), 1)


def test_selective_recompute(runs) -> None:  # noqa: ANN001
    """1F1B with SR (attention cores dropped after F, recomputed before BW)."""
    p, results = runs
    _check(results[("gpt", "1f1b-recompute[selective]", 1)], GPT, 2 * p, 1)


def test_balanced_partition(runs) -> None:  # noqa: ANN001
    """ZB-V on the --partition auto split (uneven layer counts) trains like one device too."""
    p, results = runs
    _check(results[("gpt", "zb-v[auto]", 1)], GPT, 2 * p, 1)


@pytest.mark.parametrize("name", MLP_SCHEDULES)
def test_multi_tensor_boundaries(runs, name: str) -> None:  # noqa: ANN001
    p, results = runs
    _check(results[("mlp", name, 1)], MLP, 2 * p, 1)


@pytest.mark.parametrize("name", DP_SCHEDULES)
def test_data_parallel_replicas(runs, name: str) -> None:  # noqa: ANN001
    p, results = runs
    if p != 4:
        pytest.skip("data parallelism runs in the 4-process launch")
    _check(results[("gpt", name, 2)], GPT, 4, 2)
