"""Expert parallelism under mixed precision (``mixed_precision="bf16"``) at pp 2 x ep 2, in the
shared 4-rank launch: the MoE of one's own (float32 masters, every pass on bfloat16 copies)
under 1F1B, ZB-H1 (the B/W split) and 1F1B with FSDP2 (``fsdp=True``: the replicated weights
sharded over the 2 ``ep`` ranks, the experts left whole), two SGD steps.

The reference is one process under the same policy by hand (as ``test_mixed_precision``'s): a
bfloat16 copy of the float32 model, each replica's micro-batches in turn, each output cast to
float32 for the loss, each micro-batch's bfloat16 gradient added into float32 sums, the two
replicas (the ``ep`` ranks) averaged in float32, an SGD step on the masters. Before the second
step the reference takes the pipeline's weights after the first, so both steps start alike.

What is bit-equal: every loss, and the gradient of every parameter outside the experts
(embedding, routers, head). Every op computes on the same bfloat16 values: an expert's output
for a token does not depend on which other tokens it runs with, so the forward and the
gradients flowing back through the all-to-all are the reference's. What is not: an expert's
own gradient. In the pipeline, the backward of one micro-batch gives the expert the tokens of
that micro-batch of both ``ep`` ranks at once (the all-to-all brought them), so its bfloat16
matmul sums both replicas' tokens, in the all-to-all's order, before the one rounding to
bfloat16 and the float32 accumulation; the reference rounds each replica's sum on its own.
The difference is bfloat16 rounding (8 mantissa bits, 2^-8 = 3.9e-3 relative per rounding):
each expert parameter's gradient within 1e-2 of the reference's in relative norm
(``EXPERT_RTOL``; measured worst 3.8e-3, the experts' whole gradient 2.3e-3, the same in the
three cases). Against float32 training the whole gradient is within 5e-2 (measured 3.2e-2:
bfloat16 compute itself, the reference's as much; of the first step's 512 (token, layer)
routings 3 pick other experts in bfloat16 than in float32). The float64 paths are
``test_expert_parallel``'s (unchanged, rtol 1e-9).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ep_models as em
import pytest
import shared_launch
import torch
from bf16_reference import policy_step, relative
from torch import nn

import flexpipe
from flexpipe.runtime.models import moe
from flexpipe.runtime.transport.engines import full, is_sharded

M, LR, STEPS, EP = 2, 0.1, 2, 2
CASES = (("1f1b", False), ("zb-h1", False), ("1f1b", True))
"""(schedule, FSDP2)."""
EXPERT_RTOL = 1e-2
"""An expert parameter's gradient against the reference's, relative norm (module docstring)."""


def _layers() -> list[nn.Module]:
    """The MoE of one's own in float32 (the masters), seeded alike everywhere."""
    return moe.layers(dataclasses.replace(em.SIZE, blocks=4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, em.VOCAB, (4 * M * EP, em.SEQ),
                        generator=torch.Generator().manual_seed(step))
    return ids, ids.roll(-1, 1)


def train(schedule: str, sharded: bool, steps: int = STEPS, **options: Any) -> dict[str, Any]:
    """``steps`` SGD steps on this rank of pp 2 x ep 2 (``options``: more of
    ``flexpipe.pipeline``'s, ``dp=2``): per step its gradients and weights after the update
    (float32, whole, by name), its loss; the dtypes its parameters and gradients had; the
    names of the experts it holds."""
    pipe = flexpipe.pipeline(_layers(), schedule, m=M, ep=EP, ep_plan=em.OWN_PLAN,
                             loss_fn=em.own_loss, mixed_precision="bf16", fsdp=sharded,
                             **options)
    opt = torch.optim.SGD(pipe.param_groups(), lr=LR)
    experts = {id(p) for shard in pipe.worker.experts for p in shard.params}
    out: dict[str, Any] = {"grads": [], "weights": [], "loss": [], "dtypes": set(),
                           "experts": [n for n, p in pipe.named_parameters() if id(p) in experts],
                           "meshes": {p.device_mesh.ndim for p in pipe.parameters()
                                      if is_sharded(p)}}
    for step in range(steps):
        opt.zero_grad(set_to_none=False)
        ids, target = _batch(step)
        loss = pipe.step(ids.chunk(pipe.dp)[pipe.replica] if pipe.needs_inputs else None,
                         target.chunk(pipe.dp)[pipe.replica] if pipe.needs_targets else None)
        out["grads"].append({n: full(p.grad).clone() for n, p in pipe.named_parameters()})
        out["dtypes"] |= {str(t.dtype) for _, p in pipe.named_parameters() for t in (p, p.grad)}
        out["loss"].append(None if loss is None else float(loss))
        opt.step()
        out["weights"].append(pipe.full_named_parameters())
    return out


def _run() -> list[dict[str, Any]]:
    return [train(*case) for case in CASES]


shared_launch.register(4, "experts-bf16", lambda: (_run, ()))


def _hsdp_against_fsdp() -> dict[str, Any]:
    """On one rank of pp 2 x dp 2 x ep 2 under bf16, 1F1B, one step: HSDP (2 replica groups of
    the 2 ep ranks, FSDP2's 2-D mesh) against FSDP2 over the 4 ranks of dp x ep (its 1-D
    mesh). The experts' gradients (averaged over dp alone, in float32 either way) are
    bit-equal; the others could differ by float32's order of summing over the 4 replicas (a
    reduce-scatter and an all-reduce against one reduce-scatter): ``others``, the worst
    relative difference of any of them (measured 0: sums of a few bfloat16 gradients are
    exact in float32)."""
    hsdp = train("1f1b", True, steps=1, dp=2, dp_replicate=2)
    flat = train("1f1b", True, steps=1, dp=2)
    experts = set(hsdp["experts"])
    got, want = hsdp["grads"][0], flat["grads"][0]
    return {"experts": sorted(experts), "dtypes": hsdp["dtypes"],
            "meshes": (hsdp["meshes"], flat["meshes"]),
            "experts_equal": all(torch.equal(got[n], want[n]) for n in experts),
            "others": max(float((got[n] - want[n]).abs().max() / want[n].abs().max())
                          for n in set(got) - experts)}


shared_launch.register(8, "experts-bf16-hsdp", lambda: (_hsdp_against_fsdp, ()))


class Reference:
    """One process under the same policy (the module's docstring); ``fp32``: in float32."""

    def __init__(self, fp32: bool = False) -> None:
        self.fp32 = fp32
        self.master = nn.ModuleList(_layers())

    def step(self, step: int) -> tuple[dict[str, torch.Tensor], list[float]]:
        """Gradients (float32, averaged over the replicas) and each replica's loss."""
        return policy_step(self.master, _batch(step), EP, M, LR, _forward_loss, self.fp32)


def _forward_loss(low: nn.Module, xm: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
    return em.own_loss(*(o.float() for o in em.chain(low, xm)), ym)


def _joined(grads: dict[str, torch.Tensor], names: set[str]) -> torch.Tensor:
    return torch.cat([grads[n].flatten() for n in sorted(names)])


def _check(case: tuple[str, bool], ranks: list[dict[str, Any]]) -> dict[str, float]:
    """Every step of ``case`` against the reference at the same weights; the worst relative
    error of an expert parameter's gradient, of the experts' whole and of the whole against
    float32."""
    same, fp32 = Reference(), Reference(fp32=True)
    experts = {n for r in ranks for n in r["experts"]}
    worst = {"expert": 0.0, "experts": 0.0, "fp32": 0.0}
    for step in range(STEPS):
        fp32.master.load_state_dict(same.master.state_dict())
        want, losses = same.step(step)
        loose, _ = fp32.step(step)
        got = {n: g for r in ranks for n, g in r["grads"][step].items()}
        assert set(got) == set(want) and experts and experts < set(got), case
        for name in set(got) - experts:
            assert all(torch.equal(r["grads"][step][name], want[name]) for r in ranks
                       if name in r["grads"][step]), (case, step, name)
        for name in experts:
            worst["expert"] = max(worst["expert"], relative(got[name], want[name]))
        worst["experts"] = max(worst["experts"], relative(_joined(got, experts),
                                                      _joined(want, experts)))
        worst["fp32"] = max(worst["fp32"], relative(_joined(got, set(got)),
                                                _joined(loose, set(got))))
        found = [r["loss"][step] for r in ranks if r["loss"][step] is not None]
        assert len(found) == EP and all(v in losses for v in found), (case, step, found)
        weights = {n: w for r in ranks for n, w in r["weights"][step].items()}
        same.master.load_state_dict(weights)  # the next step from the pipeline's weights
    assert all(r["dtypes"] == {"torch.float32"} for r in ranks), case
    assert worst["expert"] < EXPERT_RTOL and worst["experts"] < 1e-2, (case, worst)
    assert worst["fp32"] < 5e-2, (case, worst)
    return worst


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    f"{s}{' fsdp' if f else ''}" for s, f in CASES])
def test_pp2_ep2_bf16_against_one_process(index: int) -> None:
    results = shared_launch.results(4, "experts-bf16")
    _check(CASES[index], [r[index] for r in results])


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_hsdp_under_bf16_averages_the_experts_over_dp_in_float32() -> None:
    """HSDP x EP under bf16 (``_hsdp_against_fsdp``): float32 masters and gradients, the
    experts' gradients bit-equal to FSDP2's over dp x ep, the others within float32's
    rounding."""
    results = shared_launch.results(8, "experts-bf16-hsdp")
    assert all(r["experts"] and r["experts_equal"] for r in results), results
    assert all(r["dtypes"] == {"torch.float32"} and r["meshes"] == ({2}, {1}) for r in results)
    assert max(r["others"] for r in results) <= 1e-5, [r["others"] for r in results]
