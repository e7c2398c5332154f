"""FSDP2 under any schedule (``flexpipe.pipeline(..., fsdp=True)``, ``flexpipe.ir.sharded``):
under 1F1B, ZB-H1, ZB-V and interleaved 1F1B every stage is sharded over the data-parallel
ranks, each of its transformer blocks an FSDP2 unit of its own and then the stage root
(``engines.blocks``), gathered once per step before its first pass and reduce-scattered after
its last; two steps of SGD equal one process on the whole batch (loss, every parameter), and
the schedule the pipeline runs carries one AG and one RS per stage. At pp 2 x dp 2 in the
shared 4-rank launch, with a torch.export'ed Hugging Face Llama whose decoder layers are the
units; HSDP (``dp_replicate=2``: 2 replica groups of 2 shards, FSDP2 on the 2-D
mesh) at pp 2 x dp 4 in the shared 8-rank launch, where one HSDP job of the runtime's own
training loop (``TrainConfig.dp_replicate``, what ``run --dp 4 --fsdp --dp-replicate 2``
trains) also equals one process and holds the parameter and gradient bytes per rank
``predicted_param_bytes`` predicts (shards over dp_shard only), within 10%."""

from __future__ import annotations

from typing import Any

import gpt_replicas as gr
import pytest
import shared_launch
import torch
import user_models as um
from torch import nn

import flexpipe
from flexpipe.ir.sharded import shard_per_step
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.measurement.fsdp_memory import predicted_param_bytes
from flexpipe.runtime.models.gpt import GPTConfig, gpt_layers, lm_loss
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, TrainConfig, build_rank, run_job
from flexpipe.runtime.transport.engines import blocks
from flexpipe.schedules import registry

CFG = GPTConfig(vocab=32, hidden=16, heads=4, layers=10, seq=8)
"""10 blocks: every stage of 2 (pp 2) or 4 (a V, interleaved) holds at least 2."""
M, STEPS, LR = 4, 2, 0.1
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")
LLAMA = ("1f1b", "zb-h1")
"""The exported Llama's schedules (2 stages)."""
JOB_MODEL = ModelSpec("gpt", layers=4, hidden=16, heads=4, vocab=32, seq=8, micro_batch=2,
                      dtype="float64")
"""The HSDP job of the runtime's training loop (2 blocks per stage at pp 2)."""
Result = tuple[list[float | None], dict[str, torch.Tensor], list[str], int, dict[int, int]]


def _train(name: str, dp: int, replicate: int) -> Result:
    pipe = flexpipe.pipeline(gr.layers(CFG), name, loss_fn=lm_loss, m=M, dp=dp, fsdp=True,
                             dp_replicate=replicate)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = gr.batch(CFG, step, dp, M)
        mine_x, mine_y = x.chunk(dp)[pipe.replica], y.chunk(dp)[pipe.replica]
        opt.zero_grad()
        loss = pipe.step(mine_x if pipe.needs_inputs else None,
                         mine_y if pipe.needs_targets else None)
        opt.step()
        losses.append(None if loss is None else float(loss))
    kinds = [op.kind for op in pipe.schedule.ranks[pipe.worker.pipe_rank]
             if op.kind in ("AG", "RS")]
    units = {s: len(sh.units) for s, sh in pipe.worker.shards.items()}
    return losses, pipe.full_named_parameters(), kinds, pipe.replica, units


def fsdp_main(dp: int = 2, replicate: int = 1) -> list[Result]:
    """Per schedule on this rank: the losses, every parameter after training, its AG/RS, its
    replica and its stages' FSDP2 units."""
    return [_train(name, dp, replicate) for name in SCHEDULES]


def _exported_llama(schedule: str) -> tuple[float, dict[int, int]]:
    """pp 2 x dp 2, ``fsdp=True``: a Hugging Face Llama of 4 decoder layers cut by
    torch.export at ``model.layers.2`` (2 layers per stage, each its own FSDP2 unit), 2 SGD
    steps: the worst relative parameter error against one process on the whole batch, and
    this rank's stages' FSDP2 units."""
    import copy

    import matrix_models as mm

    entry = mm.MODELS["llama"]
    torch.manual_seed(0)
    model = mm.llama(4)
    ref = copy.deepcopy(model)
    example, _ = mm.split_batch(entry, entry.data(0, 2))
    pipe = flexpipe.pipeline(model, schedule, m=2, dp=2, fsdp=True,
                             split_points=("model.layers.2",), example=example)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = mm.worst_against_one_process(pipe, ref, entry, STEPS, opt, ref_opt)
    return worst, {s: len(sh.units) for s, sh in pipe.worker.shards.items()}


def four_main(hf: bool) -> tuple[list[Result], list[tuple[float, dict[int, int]]]]:
    """The 4-rank part: every schedule at pp 2 x dp 2, then (with ``hf``) the exported Llama
    under 1F1B and ZB-H1."""
    return fsdp_main(), [_exported_llama(name) for name in LLAMA] if hf else []


def _hsdp_schedule() -> Any:
    return shard_per_step(registry.build("1f1b", 2, M))


def _hsdp_job() -> tuple[Any, float]:
    """The HSDP job (pp 2 x 2 replica groups x 2 shards) on this rank: its result and the
    peak parameter and gradient bytes it measured."""
    import torch.distributed as dist

    train = TrainConfig(steps=STEPS, dp=4, dp_replicate=2, capture=True, measure_memory=True,
                        timeout_s=120)
    res = run_job(Job(_hsdp_schedule(), JOB_MODEL, train), dist.get_rank(),
                  dist.get_world_size())
    return res, max(res.param_bytes)


def hsdp_main() -> tuple[list[Result], tuple[Any, float]]:
    """The 8-rank part: every schedule under HSDP through ``flexpipe.pipeline``, then the
    runtime's own HSDP job."""
    return fsdp_main(4, 2), _hsdp_job()


shared_launch.register(4, "fsdp-every-schedule",
                       lambda: (four_main, (um.installed("transformers"),)))
shared_launch.register(8, "hsdp-every-schedule", lambda: (hsdp_main, ()))


def _check(results: list[list[Result]], dp: int) -> None:
    losses, params = gr.one_process(CFG, STEPS, dp, M, LR)
    assert len(results) == 2 * dp
    for i, name in enumerate(SCHEDULES):
        for rank, per_case in enumerate(results):
            got_losses, got_params, kinds, replica, units = per_case[i]
            stages = 2 if name in ("zb-v", "interleaved-1f1b") else 1
            assert kinds.count("AG") == kinds.count("RS") == stages, (name, rank, kinds)
            assert len(units) == stages and min(units.values()) >= 3, (name, rank, units)
            for got, want in zip(got_losses, losses, strict=True):
                if got is not None:
                    assert got == pytest.approx(want[replica], rel=1e-10), (name, rank)
            assert got_params and set(got_params) <= set(params), (name, rank)
            for key, p in got_params.items():
                torch.testing.assert_close(p, params[key], rtol=1e-10, atol=1e-12,
                                           msg=f"{name} rank {rank} {key}")
        held = {k for per_case in results for k in per_case[i][1]}
        assert held == set(params), name


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_fsdp_under_every_schedule_equals_one_process() -> None:
    _check([r[0] for r in shared_launch.results(4, "fsdp-every-schedule")], 2)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_an_exported_llamas_decoder_layers_are_fsdp_units() -> None:
    """torch.export'ed Llama: each stage's 2 decoder layers (their parameters grouped by
    ``TracedStage``) and its root are FSDP2 units; the parameters equal one process's."""
    pytest.importorskip("transformers")
    for rank, (_, per_schedule) in enumerate(shared_launch.results(4, "fsdp-every-schedule")):
        for name, (worst, units) in zip(LLAMA, per_schedule, strict=True):
            assert worst <= 1e-9, (name, rank, worst)
            assert list(units.values()) == [3], (name, rank, units)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_hsdp_under_every_schedule_equals_one_process() -> None:
    _check([r[0] for r in shared_launch.results(8, "hsdp-every-schedule")], 4)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_an_hsdp_job_equals_one_process_and_its_memory_is_predicted() -> None:
    """``TrainConfig(dp=4, dp_replicate=2)``: parameters after training equal one process's;
    the peak parameter + gradient bytes per rank (FSDP2's shards over dp_shard = 2, the
    gathered parameters and unsharded gradients) as predicted, within 10%."""
    jobs = [r[1] for r in shared_launch.results(8, "hsdp-every-schedule")]
    ref = reference_run(JOB_MODEL, TrainConfig(steps=STEPS, dp=4), M)
    for res, _ in jobs:
        assert set(res.params) <= set(ref.params)
        for key, p in res.params.items():
            torch.testing.assert_close(p, ref.params[key], rtol=1e-9, atol=1e-12)
    schedule = _hsdp_schedule()
    sizes = []
    for s in range(schedule.num_stages):
        stages, _ = build_rank(Job(schedule, JOB_MODEL), schedule.placement.stage_rank[s])
        sizes.append(sum(p.numel() * p.element_size() for p in stages[s].parameters()))
    predicted = predicted_param_bytes(schedule, sizes, 4, replicate=2)
    plain = predicted_param_bytes(schedule, sizes, 4)
    for res, measured in jobs:
        assert abs(measured / predicted[res.pipe_rank] - 1) <= 0.10, \
            (res.rank, measured, predicted)
        assert measured > plain[res.pipe_rank]  # the shards are over 2 ranks, not 4


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)


def test_a_stages_repeated_blocks_are_its_fsdp_units() -> None:
    """The GPT's blocks (not its embedding or head), a traced model's ``layers.N`` found below
    its root, none for a stage of one block, and none where two blocks share a weight."""
    layers = gpt_layers(GPTConfig(vocab=32, hidden=16, heads=4, layers=3, seq=8))
    assert blocks(StageModule(layers[:4], 0)) == layers[1:4]
    assert blocks(StageModule(layers[:2], 0)) == []
    net = nn.Module()
    net.model = nn.Module()
    net.model.layers = nn.Module()
    for i in range(3):
        net.model.layers.add_module(str(i), _Pair())
    net.model.embed = nn.Embedding(4, 2)
    assert blocks(net) == list(net.model.layers.children())
    tied = [_Pair(), _Pair()]
    tied[1].a = tied[0].a
    assert blocks(nn.ModuleList(tied)) == []
