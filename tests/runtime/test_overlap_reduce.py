"""The data-parallel reduction behind compute (``flexpipe.runtime.execution.reducer``) at pp 2 x
dp 2: under 1F1B, ZB-H1 and ZB-V each stage's gradients start to average at the stage's last
backward op of the step (a ZB-V rank holds two stages, so its first bucket starts while its
other stage still computes), and the gradients equal, bit for bit, those of the same step with
every gradient averaged after it (and one process's on the whole batch). In the shared 4-rank
launch (``shared_launch``)."""

from __future__ import annotations

import pytest
import shared_launch
import torch

import flexpipe
from flexpipe.ir.kinds import KINDS
from flexpipe.runtime.models.gpt import GPTConfig, gpt_layers, lm_loss

CFG = GPTConfig(vocab=32, hidden=16, heads=4, layers=4, seq=8)
M, DP = 4, 2
SCHEDULES = ("1f1b", "zb-h1", "zb-v")


def _model() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [layer.double() for layer in gpt_layers(CFG)]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab, (2 * M * DP, CFG.seq + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def _step(name: str, overlap: bool) -> tuple[dict[str, torch.Tensor], list[int], list[int]]:
    """This rank's gradients by name, where its buckets started and its gradient ops' places."""
    pipe = flexpipe.pipeline(_model(), name, loss_fn=lm_loss, m=M, dp=DP,
                             overlap_reduce=overlap)
    x, y = _batch()
    mine_x, mine_y = x.chunk(DP)[pipe.replica], y.chunk(DP)[pipe.replica]
    pipe.step(mine_x if pipe.needs_inputs else None, mine_y if pipe.needs_targets else None)
    grads = {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}
    reducer = pipe.worker.reducer
    ops = pipe.worker.executor.ops
    grad_ops = [i for i, op in enumerate(ops) if KINDS[op.kind].grads]
    return grads, ([] if reducer is None else list(reducer.started)), grad_ops


def overlap_main() -> list[tuple[bool, list[int], list[int], dict[str, torch.Tensor]]]:
    """Per schedule on this rank: overlapped == after-step gradients bit for bit, where the
    buckets started, the gradient ops' places, and the overlapped gradients."""
    out = []
    for name in SCHEDULES:
        on, started, grad_ops = _step(name, True)
        off, none, _ = _step(name, False)
        assert not none
        same = on.keys() == off.keys() and all(torch.equal(on[k], off[k]) for k in on)
        out.append((same, started, grad_ops, on))
    return out


shared_launch.register(4, "overlap-reduce", lambda: (overlap_main, ()))


def _reference() -> dict[str, torch.Tensor]:
    """One process on the replicas' micro-batches, each loss / (m x dp)."""
    model = torch.nn.Sequential(*_model())
    x, y = _batch()
    for xs, ys in zip(x.chunk(M * DP), y.chunk(M * DP), strict=True):
        (lm_loss(model(xs), ys) / (M * DP)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_reduction_starts_at_each_stages_last_backward_and_changes_nothing() -> None:
    results = shared_launch.results(4, "overlap-reduce")
    want = _reference()
    for i, name in enumerate(SCHEDULES):
        for rank, per_case in enumerate(results):
            same, started, grad_ops, grads = per_case[i]
            assert same, (name, rank)
            stages = 2 if name == "zb-v" else 1
            assert len(started) == stages, (name, rank, started)
            assert started[-1] == grad_ops[-1], (name, rank)  # the last stage at its last op
            if stages == 2:  # the other stage's bucket flies while this rank computes on
                assert started[0] < grad_ops[-1], (name, rank, started)
            for key, g in grads.items():
                torch.testing.assert_close(g, want[key], rtol=1e-10, atol=1e-12)
