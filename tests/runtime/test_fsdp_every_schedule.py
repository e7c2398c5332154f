"""FSDP2 under any schedule (``flexpipe.pipeline(..., fsdp=True)``, ``flexpipe.ir.sharded``) at
pp 2 x dp 2: under 1F1B, ZB-H1, ZB-V and interleaved 1F1B every stage is sharded over the
replicas, gathered once per step before its first pass and reduce-scattered after its last;
two steps of SGD equal one process on the whole batch (loss, every parameter), and the
schedule the pipeline runs carries one AG and one RS per stage. In the shared 4-rank launch
(``shared_launch``)."""

from __future__ import annotations

import pytest
import shared_launch
import torch

import flexpipe
from flexpipe.runtime.models.gpt import GPTConfig, gpt_layers, lm_loss

CFG = GPTConfig(vocab=32, hidden=16, heads=4, layers=4, seq=8)
M, DP, STEPS, LR = 4, 2, 2, 0.1
SCHEDULES = ("1f1b", "zb-h1", "zb-v", "interleaved-1f1b")


def _model() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [layer.double() for layer in gpt_layers(CFG)]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, CFG.vocab, (2 * M * DP, CFG.seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _train(name: str) -> tuple[list[float | None], dict[str, torch.Tensor], list[str], int]:
    pipe = flexpipe.pipeline(_model(), name, loss_fn=lm_loss, m=M, dp=DP, fsdp=True)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        mine_x, mine_y = x.chunk(DP)[pipe.replica], y.chunk(DP)[pipe.replica]
        opt.zero_grad()
        loss = pipe.step(mine_x if pipe.needs_inputs else None,
                         mine_y if pipe.needs_targets else None)
        opt.step()
        losses.append(None if loss is None else float(loss))
    kinds = [op.kind for op in pipe.schedule.ranks[pipe.worker.pipe_rank]
             if op.kind in ("AG", "RS")]
    return losses, pipe.full_named_parameters(), kinds, pipe.replica


def fsdp_main() -> list[tuple[list[float | None], dict[str, torch.Tensor], list[str], int]]:
    """Per schedule on this rank: the losses, every parameter after training, its AG/RS."""
    return [_train(name) for name in SCHEDULES]


shared_launch.register(4, "fsdp-every-schedule", lambda: (fsdp_main, ()))


def _reference() -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process: per step each replica's mean loss (what its pipeline returns), and the
    parameters after training."""
    model = torch.nn.Sequential(*_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        per_replica = [0.0] * DP
        for j, (xs, ys) in enumerate(zip(x.chunk(M * DP), y.chunk(M * DP), strict=True)):
            loss = lm_loss(model(xs), ys)
            (loss / (M * DP)).backward()
            per_replica[j // M] += float(loss.detach()) / M
        opt.step()
        losses.append(per_replica)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_fsdp_under_every_schedule_equals_one_process() -> None:
    results = shared_launch.results(4, "fsdp-every-schedule")
    losses, params = _reference()
    for i, name in enumerate(SCHEDULES):
        for rank, per_case in enumerate(results):
            got_losses, got_params, kinds, replica = per_case[i]
            stages = 2 if name in ("zb-v", "interleaved-1f1b") else 1
            assert kinds.count("AG") == kinds.count("RS") == stages, (name, rank, kinds)
            for got, want in zip(got_losses, losses, strict=True):
                if got is not None:
                    assert got == pytest.approx(want[replica], rel=1e-10), (name, rank)
            assert got_params and set(got_params) <= set(params), (name, rank)
            for key, p in got_params.items():
                torch.testing.assert_close(p, params[key], rtol=1e-10, atol=1e-12,
                                           msg=f"{name} rank {rank} {key}")
        held = {k for per_case in results for k in per_case[i][1]}
        assert held == set(params), name
