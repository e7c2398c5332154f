"""Mixed precision (``mixed_precision="bf16"``): float32 master weights and gradients, every
pass on bfloat16 copies, each micro-batch's bfloat16 gradient added into float32.

The reference is one process running the same policy by hand, without FlexPipe: a bfloat16
copy of the float32 model, each micro-batch's forward on bfloat16 inputs, its output cast to
float32 for the loss, its backward's bfloat16 gradients added into float32 sums in micro-batch
order (replicas averaged in float32), and after an SGD step on the float32 masters a fresh
bfloat16 copy. Every op of a pipeline computes what the reference computes on the same bfloat16
values (a stage boundary only detaches; gloo carries bfloat16 as is) and the float32 sums run
in the same micro-batch order, so the gradients of both steps and the losses are bit-equal,
also under the B/W split (W's products are the fused backward's), with recompute and offload,
on FSDP2-sharded stages (zeropp) and over data-parallel replicas. Against float32 training the
gradients are within bfloat16's rounding: under 1e-2 relative over the whole gradient (8
mantissa bits, about 4e-3 per rounding, over a few layers), under 5e-2 for each parameter (a
LayerNorm bias's gradient, a sum of terms that cancel, loses more), the float32 references
starting each step from the same master weights. A reference summing the micro-batches in
bfloat16 differs, so the float32 accumulation is what the equality checks.
"""

from __future__ import annotations

from typing import Any

import pytest
import shared_launch
import torch
from bf16_reference import policy_step, relative
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.ir.lower import lower
from flexpipe.runtime.execution.precision import BF16, MixedPrecision, policy
from flexpipe.runtime.measurement.measure import measured_trace
from flexpipe.runtime.measurement.memory_check import memory_cost
from flexpipe.runtime.models.gpt import GPTConfig, gpt_layers, lm_loss
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.sim.engine import simulate
from flexpipe.specs import load

M, LR = 4, 0.1
CFG = GPTConfig(vocab=32, hidden=16, heads=4, layers=2, seq=8)
CASES_2 = [("gpipe", 1, "mlp"), ("1f1b", 1, "mlp"), ("zb-h1", 1, "mlp"), ("zb-h1", 1, "gpt"),
           ("zb-v", 1, "gpt"), ("interleaved-1f1b", 1, "mlp"), ("zeropp", 1, "mlp"),
           ("1f1b-recompute", 1, "gpt"), ("1f1b-offload", 1, "mlp")]
CASES_4 = [("1f1b", 2, "gpt"), ("zeropp", 2, "mlp")]
"""(schedule, data-parallel replicas, model)."""


def _mlp() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(),
            nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8)]


def _gpt() -> list[nn.Module]:
    torch.manual_seed(0)
    return gpt_layers(CFG)


MODELS: dict[str, Any] = {
    "mlp": (_mlp, lambda o, t: nn.functional.mse_loss(o, t)),
    "gpt": (_gpt, lm_loss),
}


def _batch(kind: str, n: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3 + step)
    if kind == "gpt":
        ids = torch.randint(0, CFG.vocab, (n, CFG.seq + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(n, 16, generator=gen), torch.randn(n, 8, generator=gen)


class Reference:
    """One process under the same policy (see the module's docstring)."""

    def __init__(self, kind: str, dp: int, fp32: bool = False, bf16_sums: bool = False) -> None:
        make, self.loss = MODELS[kind]
        self.kind, self.dp, self.fp32, self.bf16_sums = kind, dp, fp32, bf16_sums
        self.master = nn.Sequential(*make())

    def step(self, step: int) -> tuple[dict[str, torch.Tensor], list[float]]:
        """Gradients (float32, averaged over replicas) and each replica's loss."""
        return policy_step(self.master, _batch(self.kind, 2 * M * self.dp, step), self.dp, M,
                           LR, self._forward_loss, self.fp32, self.bf16_sums)

    def _forward_loss(self, low: nn.Module, xm: torch.Tensor, ym: torch.Tensor) -> torch.Tensor:
        inputs = xm if self.fp32 or not xm.is_floating_point() else xm.bfloat16()
        return self.loss(low(inputs).float(), ym)


def train(schedule: str, dp: int, kind: str) -> dict[str, Any]:
    """Two SGD steps on this rank; per step its gradients (float32 copies by name), its loss,
    and the dtypes its parameters and gradients had."""
    make, loss_fn = MODELS[kind]
    extra = {"v": 2} if schedule == "zeropp" else {}
    pipe = flexpipe.pipeline(make(), schedule, loss_fn=loss_fn, m=M, dp=dp,
                             mixed_precision="bf16", **extra)
    opt = torch.optim.SGD(pipe.param_groups(), lr=LR)
    out: dict[str, Any] = {"grads": [], "loss": [], "dtypes": set()}
    for step in range(2):
        opt.zero_grad(set_to_none=False)
        x, y = _batch(kind, 2 * M * dp, step)
        mine_x, mine_y = x.chunk(dp)[pipe.replica], y.chunk(dp)[pipe.replica]
        loss = pipe.step(mine_x if pipe.needs_inputs else None,
                         mine_y if pipe.needs_targets else None)
        full = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                for n, p in pipe.named_parameters()}
        out["dtypes"] |= {str(t.dtype) for _, p in pipe.named_parameters() for t in (p, p.grad)}
        out["grads"].append(full)
        out["loss"].append(None if loss is None else float(loss))
        opt.step()
    out["eval"] = None
    if schedule != "zeropp":  # eval runs the forwards alone: no AG gathers a shard
        x, _ = _batch(kind, 2 * M, 9)
        evaluated = pipe.eval(x if pipe.needs_inputs else None)
        out["eval"] = None if evaluated is None else str(evaluated.dtype)
    return out


def _run(cases: list[tuple[str, int, str]]) -> list[dict[str, Any]]:
    return [train(*case) for case in cases]


shared_launch.register(2, "mixed-precision", lambda: (_run, (CASES_2,)))
shared_launch.register(4, "mixed-precision", lambda: (_run, (CASES_4,)))


def _check(case: tuple[str, int, str], ranks: list[dict[str, Any]]) -> None:
    schedule, dp, kind = case
    same, fp32, bf16_sums = Reference(kind, dp), Reference(kind, dp, fp32=True), \
        Reference(kind, dp, bf16_sums=True)
    for step in range(2):
        for ref in (fp32, bf16_sums):  # at the same master weights
            ref.master.load_state_dict(same.master.state_dict())
        want, losses = same.step(step)
        loose, _ = fp32.step(step)
        coarse, _ = bf16_sums.step(step)
        got = {n: g for r in ranks for n, g in r["grads"][step].items()}
        assert set(got) == set(want), case
        for name, g in got.items():
            assert torch.equal(g, want[name]), (case, step, name, float((g - want[name]).abs()
                                                                        .max()))
            rel = relative(g, loose[name])
            assert rel < 5e-2, (case, step, name, rel)
        whole = relative(torch.cat([g.flatten() for g in got.values()]),
                     torch.cat([loose[n].flatten() for n in got]))
        assert whole < 1e-2, (case, step, whole)
        assert any(not torch.equal(got[n], coarse[n]) for n in got), case
        found = [r["loss"][step] for r in ranks if r["loss"][step] is not None]
        assert found and all(v in losses for v in found), (case, step, found, losses)
    for r in ranks:
        assert r["dtypes"] == {"torch.float32"}, (case, r["dtypes"])
        assert r["eval"] in (None, "torch.float32"), case
    assert any(r["eval"] for r in ranks) or schedule == "zeropp", case


MEMORY = [(schedule, mp, "sgd") for schedule in ("1f1b", "zb-h1") for mp in (None, BF16)] + \
    [("zb-h1", mp, "adamw") for mp in (None, BF16)]
"""(schedule, policy, optimizer) of the memory runs: the built-in GPT at 2 ranks, m = 4."""


def _memory_job(schedule: str, mp: MixedPrecision | None, optimizer: str) -> Job:
    return Job(load(schedule, 2, M), ModelSpec("gpt", layers=2, hidden=32, seq=16),
               TrainConfig(steps=1, measure_memory=True, mixed_precision=mp,
                           optimizer=optimizer))


shared_launch.register(2, "mixed-precision-memory", lambda: shared_launch.jobs(
    [_memory_job(*case) for case in MEMORY], 2))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_bf16_activation_peak_is_predicted() -> None:
    """The activation peak per rank the simulator predicts from ``memory_cost`` (the stages
    measured computing as the run does) against the run's meter: within 10%; bfloat16 holds
    half of float32's but for the float32 logits the loss reads on the last rank."""
    results = shared_launch.job_results(2, "mixed-precision-memory")
    peaks = {}
    for case, ranks in zip(MEMORY, results, strict=True):
        job = _memory_job(*case)
        got = measured_trace(job.schedule, ranks).metrics().peak_activation
        want = simulate(lower(job.schedule), memory_cost(job)).metrics().peak_activation
        for rank, (w, g) in enumerate(zip(want, got, strict=True)):
            assert g > 0 and abs(w - g) / g <= 0.1, (case, rank, w, g)
        peaks[case] = got
    for schedule in ("1f1b", "zb-h1"):
        for low, high in zip(peaks[(schedule, BF16, "sgd")], peaks[(schedule, None, "sgd")],
                             strict=True):
            assert 0.4 < low / high < 0.75, (schedule, low, high)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_static_memory_is_predicted() -> None:
    """What each rank holds after the step in parameters, gradients, optimizer state and (under
    bf16) compute copies, every storage once, against ``memory_cost``'s static bytes of its
    stages: within 10% (SGD with momentum and AdamW, float32 and bf16). Under bf16 the float32
    masters, gradients and state come with a bfloat16 copy: 7/6 of float32's bytes with SGD,
    9/8 with AdamW."""
    results = shared_launch.job_results(2, "mixed-precision-memory")
    held = {}
    for case, ranks in zip(MEMORY, results, strict=True):
        job = _memory_job(*case)
        cost = memory_cost(job)
        for r, result in enumerate(ranks):
            want = sum(cost.stage(s).params for s in job.schedule.placement.rank_stages[r])
            got = result.static_bytes
            assert got > 0 and abs(want - got) / got <= 0.1, (case, r, want, got)
        held[case] = [result.static_bytes for result in ranks]
    for schedule, optimizer, ratio in (("1f1b", "sgd", 7 / 6), ("zb-h1", "sgd", 7 / 6),
                                       ("zb-h1", "adamw", 9 / 8)):
        for low, high in zip(held[(schedule, BF16, optimizer)], held[(schedule, None, optimizer)],
                             strict=True):
            assert abs(low / high - ratio) < 0.02, (schedule, optimizer, low, high)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_bf16_trains_like_one_process_under_the_same_policy() -> None:
    threads = torch.get_num_threads()
    for world, cases in ((2, CASES_2), (4, CASES_4)):
        results = shared_launch.results(world, "mixed-precision")
        torch.set_num_threads(1)  # as each rank: a reduction split over threads rounds otherwise
        try:
            for i, case in enumerate(cases):
                _check(case, [r[i] for r in results])
        finally:
            torch.set_num_threads(threads)


def test_policies_by_name() -> None:
    assert policy("bf16") == BF16 == policy("bfloat16") == policy({"param": "bf16"})
    assert policy(None) is None and policy("fp32") is None and policy("no") is None
    assert policy({"reduce": "bf16"}) == MixedPrecision(reduce_dtype=torch.bfloat16)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert policy(MixedPrecisionPolicy(param_dtype=torch.bfloat16)) == BF16
    with pytest.raises(ConfigError, match="'fp16' is not a dtype"):
        policy("fp16")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['params'\]"):
        policy({"params": "bf16"})
    with pytest.raises(ConfigError, match="param_dtype torch.float16 is not bfloat16"):
        MixedPrecision(param_dtype=torch.float16)
    with pytest.raises(ConfigError, match="got int"):
        policy(3)


NAMES = ("bf16", "bfloat16", "fp32", "float32", "BF16", " Float32 ")


@given(st.dictionaries(st.sampled_from(("param", "reduce", "output")), st.sampled_from(NAMES)))
def test_a_mapping_sets_each_dtype_it_names(chosen: dict[str, str]) -> None:
    got = policy(chosen)
    want = {k: torch.bfloat16 if "bf" in v.lower() else torch.float32
            for k, v in chosen.items()}
    full = {"param": torch.bfloat16, "reduce": torch.float32, "output": torch.float32} | want
    if full["param"] == full["reduce"] == full["output"] == torch.float32:
        assert got is None
    else:
        assert got == MixedPrecision(full["param"], full["reduce"], full["output"])


@given(st.text(max_size=8).filter(lambda t: t.strip().lower() not in
                                  ("bf16", "bfloat16", "fp32", "float32", "no", "none")))
def test_any_other_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="mixed precision"):
        policy(name)


def test_a_model_not_in_float32_is_refused() -> None:
    from flexpipe.runtime.execution.precision import check_masters

    with pytest.raises(ConfigError, match=r"rank 1: mixed precision keeps float32 master "
                                          r"weights, but stage 0's parameter weight is "
                                          r"torch.float64"):
        check_masters({0: nn.Linear(2, 2).double()}, "rank 1")
    check_masters({0: nn.Linear(2, 2), 1: nn.Embedding(3, 2)}, "rank 1")
