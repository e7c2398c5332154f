"""HSDP checkpoints and HSDP x tensor parallel, in the shared 8-rank launch.

A GPT of 4 blocks at pp 2 x 2 replica groups x 2 shards (``dp=4, fsdp=True, dp_replicate=2``,
1F1B, SGD with momentum, float64) trains one step, saves (``Pipeline.save``, DCP, with the
optimizer) and trains a second; a fresh pipeline at the same layout loads the checkpoint and
trains the same second step: its loss and parameters equal the uninterrupted run's bit for
bit. The checkpoint loads, parameters and momentum equal to the saved ones to the bit, into
pp 2 x dp 4 under FSDP2, pp 2 x dp 4 with full replicas, pp 4 x dp 2 under FSDP2 and
pp 2 x 2 replica groups x 1 shard x tp 2; DCP writes a replicated shard once (the folder's
tensor files hold one copy of the state, not one per replica group). HSDP with tensor
parallelism (pp 2 x dp_replicate 2 x dp_shard 1 x tp 2) under 1F1B and ZB-H1 trains 2 steps
equal to one process at rtol 1e-9.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gpt_replicas as gr
import pytest
import shared_launch
import torch

import flexpipe
from flexpipe.runtime.models.gpt import TP_PLAN, GPTConfig, lm_loss

CFG = GPTConfig(vocab=32, hidden=64, heads=4, layers=4, seq=8)
"""Wide enough that the checkpoint's tensor bytes outweigh DCP's bytes per entry."""
M, LR, RTOL = 2, 0.1, 1e-9
HSDP = {"dp": 4, "fsdp": True, "dp_replicate": 2}
"""The layout that writes the checkpoint (with pp 2: 8 ranks)."""
LAYOUTS = {"pp2 x dp4 fsdp": {"dp": 4, "fsdp": True},
           "pp2 x dp4 replicas": {"dp": 4},
           "pp4 x dp2 fsdp": {"dp": 2, "fsdp": True},
           "pp2 x rep2 x shard1 x tp2": {"dp": 2, "fsdp": True, "dp_replicate": 2, "tp": 2,
                                         "tp_plan": TP_PLAN}}
"""The layouts the HSDP checkpoint loads into (8 ranks each)."""
TP_SCHEDULES = ("1f1b", "zb-h1")
Full = dict[str, torch.Tensor]


def _pipe(schedule: str = "1f1b", **kw: Any) -> Any:
    """The GPT as a pipeline over the 8 ranks (``kw``: its dp, fsdp, tp...; pp the rest)."""
    return flexpipe.pipeline(gr.layers(CFG), schedule, loss_fn=lm_loss, m=M, **kw)


def _step(pipe: Any, opt: torch.optim.Optimizer, step: int) -> float | None:
    """One optimizer step of ``pipe`` on its replica's part of the batch; its loss where
    this rank computes it."""
    x, y = (t.chunk(pipe.dp)[pipe.replica] for t in gr.batch(CFG, step, pipe.dp, M))
    opt.zero_grad()
    loss = pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    opt.step()
    return None if loss is None else float(loss)


def _sgd(pipe: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(pipe.param_groups(), lr=LR, momentum=0.9)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _state(pipe: Any, opt: torch.optim.Optimizer) -> tuple[Full, Full]:
    """This rank's parameters and momentum buffers by name, as whole tensors (every rank
    calls it: FSDP2's and tensor parallelism's shards are gathered)."""
    named = list(pipe.named_parameters())
    params = {n: _whole(p) for n, p in named}
    return params, {n: _whole(opt.state[p]["momentum_buffer"]) for n, p in named}


def _tensor_bytes(path: str) -> int:
    """The bytes of the DCP folder's files that hold tensors: every ``.distcp`` file less the
    entries of plain values (the optimizer's hyperparameters), as its metadata records them."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from flexpipe.runtime.transport.safedcp import SafeReader

    meta = SafeReader(path).read_metadata()
    plain = {fqn for fqn, m in meta.state_dict_metadata.items()
             if isinstance(m, BytesStorageMetadata)}
    files = sum(f.stat().st_size for f in Path(path).glob("*.distcp"))
    return files - sum(s.length for i, s in meta.storage_data.items() if i.fqn in plain)


def _resume(path: str) -> dict[str, Any]:
    """HSDP: one step, save, a second step; then a fresh pipeline loads and takes the second
    step. The losses and parameters of both second steps, what was saved, and (rank 0) the
    checkpoint's tensor bytes."""
    pipe = _pipe(**HSDP)
    opt = _sgd(pipe)
    _step(pipe, opt, 0)
    pipe.save(path, opt)
    saved = _state(pipe, opt)
    kept = _step(pipe, opt, 1), _state(pipe, opt)[0]
    again = _pipe(**HSDP)
    opt_again = _sgd(again)
    again.load(path, opt_again)
    resumed = _step(again, opt_again, 1), _state(again, opt_again)[0]
    return {"kept": kept, "resumed": resumed, "saved": saved,
            "bytes": _tensor_bytes(path) if pipe.worker.rank == 0 else None}


def _elsewhere(path: str) -> dict[str, tuple[Full, Full]]:
    """The HSDP checkpoint loaded into each of ``LAYOUTS``: this rank's parameters and
    momentum there."""
    out = {}
    for name, kw in LAYOUTS.items():
        pipe = _pipe(**kw)
        opt = _sgd(pipe)
        pipe.load(path, opt)
        out[name] = _state(pipe, opt)
    return out


def _hsdp_tp(schedule: str) -> tuple[list[float | None], Full, int]:
    """pp 2 x dp_replicate 2 x dp_shard 1 x tp 2: the losses and whole parameters after 2
    SGD steps, and this rank's replica."""
    pipe = _pipe(schedule, dp=2, fsdp=True, dp_replicate=2, tp=2, tp_plan=TP_PLAN)
    opt = torch.optim.SGD(pipe.param_groups(), lr=LR)
    losses = [_step(pipe, opt, step) for step in range(2)]
    return losses, pipe.full_named_parameters(), pipe.replica


def eight_ranks(path: str) -> dict[str, Any]:
    """The 8-rank part: the HSDP resume, the loads into other layouts, HSDP x tp."""
    return {"resume": _resume(path), "elsewhere": _elsewhere(path),
            "tp": [_hsdp_tp(name) for name in TP_SCHEDULES]}


shared_launch.register(8, "hsdp-checkpoint-tp", lambda: (
    eight_ranks, (shared_launch.folder("flexpipe-hsdp-ck-") + "/ck",)))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    """This file's part of the shared 8-rank launch, per rank."""
    return shared_launch.results(8, "hsdp-checkpoint-tp")


def _merged(parts: list[Full]) -> Full:
    out: Full = {}
    for part in parts:
        out.update(part)
    return out


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_an_hsdp_run_resumes_bit_exact(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(ranks):
        (kept_loss, kept), (resumed_loss, resumed) = got["resume"]["kept"], \
            got["resume"]["resumed"]
        assert kept_loss == resumed_loss, rank
        assert kept.keys() == resumed.keys() and kept, rank
        for name, p in kept.items():
            assert torch.equal(p, resumed[name]), (rank, name)
    names = {n for got in ranks for n in got["resume"]["kept"][1]}
    assert len(names) == 4 * 12 + 2 + 3  # every parameter is held somewhere


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_an_hsdp_checkpoint_loads_into_other_layouts(ranks: list[dict[str, Any]]) -> None:
    params = _merged([got["resume"]["saved"][0] for got in ranks])
    momentum = _merged([got["resume"]["saved"][1] for got in ranks])
    for layout in LAYOUTS:
        held = set()
        for rank, got in enumerate(ranks):
            p, m = got["elsewhere"][layout]
            held |= set(p)
            for name in p:
                assert torch.equal(p[name], params[name]), (layout, rank, name)
                assert torch.equal(m[name], momentum[name]), (layout, rank, name)
        assert held == set(params), layout


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_dcp_writes_an_hsdp_replicas_shards_once(ranks: list[dict[str, Any]]) -> None:
    """The tensor files hold one copy of the state (parameters and momentum) and DCP's bytes
    per entry, where the 2 replica groups hold one each: DCP writes one group's shards."""
    written = ranks[0]["resume"]["bytes"]
    params = _merged([got["resume"]["saved"][0] for got in ranks])
    copy = 2 * sum(t.numel() * t.element_size() for t in params.values())
    assert copy <= written < 1.5 * copy, (written, copy)  # measured: 1.10; both groups': 2


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_hsdp_with_tensor_parallel_equals_one_process(ranks: list[dict[str, Any]]) -> None:
    want_losses, want = gr.one_process(CFG, 2, 2, M, LR)
    for i, schedule in enumerate(TP_SCHEDULES):
        held = set()
        for rank, got in enumerate(ranks):
            losses, params, replica = got["tp"][i]
            held |= set(params)
            for loss, per_replica in zip(losses, want_losses, strict=True):
                if loss is not None:
                    assert loss == pytest.approx(per_replica[replica], rel=RTOL), \
                        (schedule, rank)
            for name, p in params.items():
                torch.testing.assert_close(p, want[name], rtol=RTOL, atol=1e-12,
                                           msg=f"{schedule} rank {rank} {name}")
        assert held == set(want), schedule
