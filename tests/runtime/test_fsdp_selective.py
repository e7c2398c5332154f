"""The AG/RS (FSDP2) and SR (selective recompute) handlers on one rank, one replica (the FSDP
cases in the shared one-process launch, ``shared_launch``: torch's FSDP2 needs a process group):
parameters stay sharded between uses, compute on a stage that was not gathered fails clearly, SR
really drops the attention cores' activations and a backward without SR fails, and both give the
single-device gradients."""

from __future__ import annotations

import re

import pytest
import shared_launch
import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.ir.op import Op
from flexpipe.runtime.execution import fsdp
from flexpipe.runtime.execution.executor import Executor, Handler
from flexpipe.runtime.execution.handlers import HANDLERS
from flexpipe.runtime.execution.selective import Selective
from flexpipe.runtime.models.kinds import make_batch
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, TrainConfig, build_rank
from flexpipe.runtime.transport import mesh as grids
from flexpipe.runtime.transport.engines import Sharded, is_sharded
from flexpipe.runtime.transport.p2p import P2P
from flexpipe.schedules import registry

GPT = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2,
                dtype="float64")
M = 2


def _executor(schedule, sharded: bool, handlers: dict[str, Handler] | None = None,  # noqa: ANN001
              ) -> tuple[Executor, dict[int, Sharded]]:
    stages, loss_fn = build_rank(Job(schedule, GPT), 0)
    shards = fsdp.shard_stages(stages, grids.build(1, torch.device("cpu")).sub("dp")) \
        if sharded else {}
    p2p = P2P([0], 10.0, torch.device("cpu"))
    ex = Executor(schedule, 0, stages, loss_fn, p2p, handlers=handlers or HANDLERS,
                  shards=shards)
    return ex, shards


def _assert_reference_grads(got: dict[str, torch.Tensor]) -> None:
    ref = reference_run(GPT, TrainConfig(steps=1), M).grads
    assert sorted(got) == sorted(ref)
    for name, want in ref.items():
        assert torch.allclose(got[name], want, rtol=1e-9, atol=1e-12), name


def _zeropp_step() -> tuple[bool, dict[str, torch.Tensor]]:
    """(whether every stage is back to its shards with their gradients, the gradients)."""
    ex, shards = _executor(registry.build("zeropp", 1, M, v=2), sharded=True)
    ex.step(make_batch(GPT, 0, M))
    sharded = all(is_sharded(p) for m in ex.stages.values() for p in m.parameters())
    closed = all(sh.gathered == 0 and all(p.grad is not None for p in sh.params)
                 for sh in shards.values())
    return sharded and closed, fsdp.full_named(ex.stages, grads=True)


def _fsdp_cases() -> tuple[tuple[bool, dict[str, torch.Tensor]], str]:
    """Both one-process FSDP cases in turn (the failing step last)."""
    return _zeropp_step(), _step_without_gather()


shared_launch.register(1, "fsdp", lambda: (_fsdp_cases, ()))


@pytest.fixture(scope="module")
def fsdp_cases() -> tuple[tuple[bool, dict[str, torch.Tensor]], str]:
    """The FSDP cases in the shared launch of one process."""
    result, = shared_launch.results(1, "fsdp")
    return result  # type: ignore[no-any-return]


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_zeropp_keeps_parameters_sharded_between_uses(
        fsdp_cases: tuple[tuple[bool, dict[str, torch.Tensor]], str]) -> None:
    (ok, grads), _ = fsdp_cases
    assert ok
    _assert_reference_grads(grads)


def _step_without_gather() -> str:
    skip_gather = dict(HANDLERS, AG=lambda ex, op: None)
    ex, _ = _executor(registry.build("zeropp", 1, M, v=2), sharded=True, handlers=skip_gather)
    try:
        ex.step(make_batch(GPT, 0, M))
    except RunError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_compute_on_a_stage_not_gathered_fails_clearly(
        fsdp_cases: tuple[tuple[bool, dict[str, torch.Tensor]], str]) -> None:
    _, message = fsdp_cases
    assert re.search(r"0F0 runs on stage 0.*not gathered \(no AG", message), message


def test_an_ag_schedule_needs_sharded_stages() -> None:
    with pytest.raises(ConfigError, match="gathers parameters .AG. but stages"):
        _executor(registry.build("zeropp", 1, M, v=2), sharded=False)


def test_selective_recompute_drops_then_redoes_the_attention_cores() -> None:
    seen: list[int] = []

    def checking_sr(ex: Executor, op: Op) -> None:
        record = ex.slot(op).selective
        assert isinstance(record, Selective)
        assert len(record.calls) == GPT.layers  # one attention core per block
        assert all(s.value is None for c in record.calls for s in c.slots)
        seen.append(sum(len(c.slots) for c in record.calls))
        HANDLERS["SR"](ex, op)

    ex, _ = _executor(registry.build("1f1b-recompute", 1, M, selective=True), sharded=False,
                      handlers=dict(HANDLERS, SR=checking_sr))
    ex.step(make_batch(GPT, 0, M))
    assert len(seen) == M and all(n > 0 for n in seen)
    _assert_reference_grads({k: p.grad for m in ex.stages.values()  # type: ignore[misc]
                             for k, p in m.named_global_parameters().items()})


def test_backward_without_selective_recompute_fails() -> None:
    ex, _ = _executor(registry.build("1f1b-recompute", 1, M, selective=True), sharded=False,
                      handlers=dict(HANDLERS, SR=lambda ex, op: None))
    with pytest.raises(RunError, match="no SR ran before it"):
        ex.step(make_batch(GPT, 0, M))


def test_profile_times_selective_recompute() -> None:
    from flexpipe.runtime.measurement.profile import time_stage

    stages, loss_fn = build_rank(Job(registry.build("1f1b", 1, 1), GPT), 0)
    (inputs, target), = make_batch(GPT, 0, 1)
    got = time_stage(stages[0], tuple(inputs), lambda out: loss_fn(*out, target), True, reps=1)
    assert {"F", "BW", "SR"} <= set(got) and all(0 < got[k] for k in ("F", "BW", "SR"))
    # (how SR compares with F + BW is a timing, measured by benchmarks/profile_predict.py,
    # not asserted here: one repetition on a loaded machine took 20 ms against 1.4 ms)
