"""Expert parallelism at pp 2 x ep 2 against one process on the whole batch (float64, SGD with
momentum, 2 steps): the losses, the first step's gradients and the parameters after the steps,
for a MoE of one's own (an ``nn.ModuleList`` of experts: the ``list`` style of its
``ep_plan``) under 1F1B, ZB-H1 and ZB-V (4 stages on 2 ranks), and for Hugging Face's Qwen2-MoE
(its built-in ``stacked`` plan, the load-balancing loss included) under ZB-H1; Mixtral,
Qwen2-MoE and DeepSeek-V3 under the other schedules are ``slow``. The 4-rank cases run in the
shared 4-rank launch (``shared_launch``). Under FSDP2 (``fsdp=True``: the replicated weights
sharded over the ``ep`` ranks, the experts left whole) the MoE of one's own under 1F1B (also
resumed from a checkpoint) and under ZB-V clipped, and Qwen2-MoE under ZB-H1 equal one process;
dp 2 x ep 2 x pp 2 (FSDP2 over the 4 ranks of dp x ep) under 1F1B clipped, and the same under
HSDP (``dp_replicate=2``: FSDP2's 2-D mesh, 2 replica groups of the 2 ep ranks) under 1F1B and
ZB-H1 clipped and resumed, run in the shared 8-rank launch, and so does pp 2 x ep 2 x tp 2
(the MoE of one's own with a dense part before each MoE layer split by its tensor-parallel
plan, the experts whole on every tp rank) under 1F1B and ZB-H1 clipped. The layers as a chain
compute the family's own loss (cross-entropy plus its router's balancing loss); the plan's
errors name what is wrong."""

from __future__ import annotations

import os
import re
import types
from typing import Any

import ep_models as em
import pytest
import shared_launch
import torch
import user_models as um

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.parallel import Parallel
from flexpipe.runtime.transport.experts import expert_parallel, holder
from flexpipe.runtime.user.experts import family_plan

RTOL = 1e-9
OWN_SCHEDULES = ("1f1b", "zb-h1", "zb-v")
HF_CI = (("qwen2-moe", "zb-h1"),)
HF_SLOW = tuple((f, s) for f in em.FAMILIES for s in OWN_SCHEDULES if (f, s) not in HF_CI)


def _cases(hf: tuple[tuple[str, str], ...], folder: str) -> dict[str, dict[str, float]]:
    """On one rank: the MoE of one's own under every schedule and under DualPipeV (its pairs'
    passes at once, m = 4), clipped, resumed (checkpoints under ``folder``), and under FSDP2
    (``FSDP``), then the ``hf`` cases, also under FSDP2."""
    out = {f"own/{s}": em.train(em.own, s, em.OWN_PLAN) for s in OWN_SCHEDULES}
    out["own/dualpipev"] = em.train_overlapped("dualpipev", 4)
    out["own/zb-v clipped"] = em.train(em.own, "zb-v", em.OWN_PLAN, max_norm=0.5)
    out["resume"] = em.resumed("1f1b", folder)
    out["own/1f1b fsdp"] = em.train(em.own, "1f1b", em.OWN_PLAN, options=FSDP)
    out["own/zb-v fsdp clipped"] = em.train(em.own, "zb-v", em.OWN_PLAN, max_norm=0.5,
                                            options=FSDP)
    out["resume fsdp"] = em.resumed("1f1b", folder + "-fsdp", options=FSDP)
    for name, schedule in hf:
        out[f"{name}/{schedule}"] = em.train(em.family(name), schedule, None)
        out[f"{name}/{schedule} fsdp"] = em.train(em.family(name), schedule, None,
                                                  options=FSDP)  # its stacked experts whole
    return out


FSDP = {"fsdp": True}
"""FSDP2 over the ``dp x ep`` ranks (at dp 1: the ``ep`` dimension), the experts left whole."""


HSDP = {**FSDP, "dp": 2, "dp_replicate": 2}
"""HSDP at dp 2: 2 replica groups, each sharding over its dp 1 x ep 2 ranks (FSDP2's 2-D mesh
``(dp_replicate, dp_shard)`` = (2, 2)), the experts left whole."""


def _eight() -> dict[str, dict[str, float]]:
    """On one rank of dp 2 x ep 2 x pp 2: the MoE of one's own under FSDP2 (sharded over the
    4 ranks of dp x ep), clipped."""
    return {"own/1f1b dp2 fsdp clipped": em.train(em.own, "1f1b", em.OWN_PLAN, max_norm=0.5,
                                                  options={**FSDP, "dp": 2})}


def _hsdp(folder: str) -> dict[str, dict[str, float]]:
    """On one rank of dp 2 x ep 2 x pp 2: the MoE of one's own under HSDP (``HSDP``) with
    1F1B and ZB-H1, clipped, and resumed from a checkpoint (under ``folder``)."""
    out = {f"own/{s} hsdp clipped": em.train(em.own, s, em.OWN_PLAN, max_norm=0.5,
                                             options=HSDP) for s in ("1f1b", "zb-h1")}
    out["resume hsdp"] = em.resumed("1f1b", folder + "-hsdp", options=HSDP)
    return out


def _folder() -> str:
    """A checkpoint folder for the ranks of a launch (``shared_launch.folder``)."""
    return os.path.join(shared_launch.folder("flexpipe-ep-resume-"), "ck")


def _part() -> shared_launch.Part:
    return _cases, (HF_CI if um.installed("transformers") else (), _folder())


TP = {"tp": 2, "tp_plan": em.OWN_TP_PLAN}
"""Tensor parallelism over 2 ranks: the dense parts split, the experts whole on every tp
rank."""
TP_SCHEDULES = ("1f1b", "zb-h1")


def _eight_tp() -> dict[str, dict[str, float]]:
    """On one rank of pp 2 x ep 2 x tp 2: the MoE of one's own with dense parts, clipped,
    under ``TP_SCHEDULES`` and under 1F1B with FSDP2 (over the ``ep`` ranks of each ``tp``
    coordinate: DTensors of the ``ep`` mesh and of the ``(ep, tp)`` one); its ``ep`` groups and
    the refusal of a plan splitting experts."""
    out: dict[str, Any] = {f"own/{s} tp2 clipped": em.train(em.own_tp, s, em.OWN_PLAN,
                                                            max_norm=0.5, options=TP)
                           for s in TP_SCHEDULES}
    out["own/1f1b tp2 fsdp clipped"] = em.train(em.own_tp, "1f1b", em.OWN_PLAN, max_norm=0.5,
                                                options={**TP, **FSDP})
    out["layout"] = em.tp_layout()
    return out


shared_launch.register(4, "experts", _part)
shared_launch.register(8, "experts", lambda: (_eight, ()))
shared_launch.register(8, "experts-hsdp", lambda: (_hsdp, (_folder(),)))
shared_launch.register(8, "experts-tp", lambda: (_eight_tp, ()))


def _check(results: list[dict[str, dict[str, float]]], replicas: int = 2) -> None:
    assert len(results) == 2 * replicas
    for key in ("resume", "resume fsdp", "resume hsdp"):
        resume = [r.pop(key, None) for r in results]
        if resume[0] is not None:  # resume from a checkpoint equals the run straight through
            assert all(x is not None and x["resume"] == 0.0 for x in resume), (key, resume)
            assert sum(x["experts"] for x in resume if x is not None) > 0
    for case in results[0]:
        worst = {k: max(r[case][k] for r in results)
                 for k in ("loss", "grad", "param", "norm")}
        assert all(v <= RTOL for v in worst.values()), (case, worst)
        assert sum(r[case]["experts"] for r in results) > 0, case  # the experts are shared
        assert sum(r[case]["losses"] for r in results) == replicas * 2, case  # x 2 steps
        assert all(r[case]["sharded_experts"] == 0 for r in results), case
        if "fsdp" in case or "hsdp" in case:  # every rank shards its replicated weights
            assert all(r[case]["sharded"] > 0 for r in results), case  # over dp x ep
        assert all((r[case]["hsdp"] > 0) == ("hsdp" in case) for r in results), case
    if "own/dualpipev" not in results[0]:
        return
    dual = [r["own/dualpipev"] for r in results]
    assert all(d["vs_sequential"] == 0.0 for d in dual)  # the same results as in turn
    assert all(d["concurrent"] > 0 and d["sequential_concurrent"] == 0 for d in dual)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_pp2_ep2_equals_one_process() -> None:
    results = shared_launch.results(4, "experts")
    assert {f"own/{s}" for s in OWN_SCHEDULES} | {"own/dualpipev", "own/zb-v clipped",
                                                  "resume", "own/1f1b fsdp",
                                                  "resume fsdp"} <= set(results[0])
    _check(results)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_dp2_ep2_pp2_fsdp_equals_one_process() -> None:
    """FSDP2 over the 4 ranks of dp 2 x ep 2 per pipeline rank, and HSDP (2 replica groups of
    the 2 ep ranks) under 1F1B and ZB-H1, the experts' gradients averaged over dp alone:
    equal to one process, clipped; HSDP resumed from a checkpoint equals the run straight
    through."""
    hsdp = shared_launch.results(8, "experts-hsdp")
    assert {"own/1f1b hsdp clipped", "own/zb-h1 hsdp clipped", "resume hsdp"} <= set(hsdp[0])
    _check([{**a, **b} for a, b in zip(shared_launch.results(8, "experts"), hsdp, strict=True)],
           4)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_pp2_ep2_tp2_equals_one_process() -> None:
    """Expert parallelism beside tensor parallelism: the dense parts split over tp, the
    experts whole on every tp rank, each expert counted once by the reduction and clipping;
    equal to one process. The ep groups are one per (pp, tp) coordinate: global rank
    ``(ep * 2 + pp) * 2 + tp``, so rank r's ep peers are r mod 4 and r mod 4 + 4."""
    results = shared_launch.results(8, "experts-tp")
    layouts = [r.pop("layout") for r in results]
    for rank, (groups, refused) in enumerate(layouts):
        assert groups == [[rank % 4, rank % 4 + 4]] * 2, (rank, groups)
        assert re.search(r"splits '\d\.moe\.experts\.\d\.up', a module of the experts "
                         r"module '\d\.moe'", refused), refused
        assert "the experts stay whole on every tp rank" in refused, refused
    assert {f"own/{s} tp2 clipped" for s in TP_SCHEDULES} | {"own/1f1b tp2 fsdp clipped"} \
        == set(results[0])
    _check(results, 4)  # the losses on the last stage's 2 ep x 2 tp ranks
    assert all(r[c]["split"] > 0 for r in results for c in r if "fsdp" not in c)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hugging_face_families_under_every_schedule() -> None:
    pytest.importorskip("transformers")
    _check(flexpipe.spawn(_hf_only, 4, HF_SLOW, timeout_s=300, deadline_s=800))


def _hf_only(cases: tuple[tuple[str, str], ...]) -> dict[str, dict[str, float]]:
    return {f"{n}/{s}": em.train(em.family(n), s, None) for n, s in cases}


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "deepseek-v3"])
def test_the_chain_computes_the_familys_own_loss(name: str) -> None:
    """The layers as a chain with the float64 loss (cross-entropy plus the balancing loss)
    give the model's own ``output_router_logits=True`` loss (which computes in float32)."""
    pytest.importorskip("transformers")
    lm = em.hf_lm(name)
    ids = torch.randint(0, em.VOCAB, (2, em.SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = em.hf_loss(lm)(*em.chain(em.hf_layers(lm), ids), ids)
        theirs = lm(input_ids=ids, labels=ids).loss
    assert abs(float(mine) / float(theirs) - 1) <= 1e-6
    assert (em._balance(lm) is None) == (name == "deepseek-v3")


def test_the_built_in_plans_find_the_families() -> None:
    pytest.importorskip("transformers")
    for name in em.FAMILIES:
        assert family_plan(em.hf_layers(em.hf_lm(name))) == {"*mlp.experts": "stacked"}, name
    assert family_plan(em.own_layers()) == {}


def test_a_bad_plan_is_named() -> None:
    block = em.MoEBlock(em.HIDDEN, em.EXPERTS, em.TOP_K)
    names = {"moe": "3.moe", "router": "3.router"}
    with pytest.raises(ConfigError, match=r"unknown style\(s\) \['diagonal'\]"):
        expert_parallel(block, {"*": "diagonal"}, names, None, 2, 0)
    with pytest.raises(ConfigError, match="'3.moe' has 4 experts, which ep = 3 does not divide"):
        expert_parallel(block, {"*.moe": "list"}, names, None, 3, 0)
    with pytest.raises(ConfigError, match="'3.router' .* is not 'list'"):
        expert_parallel(block, {"*.router": "list"}, names, None, 2, 0)
    with pytest.raises(ConfigError, match="'3.moe' .* is not 'stacked'"):
        expert_parallel(block, {"*.moe": "stacked"}, names, None, 2, 0)


def test_the_experts_module_holding_a_module_is_found_by_name() -> None:
    plan = {"*.moe": "list", "*mlp.experts": "stacked"}
    assert holder("3.moe.experts.1.up", plan) == "3.moe"
    assert holder("3.moe", plan) == "3.moe"
    assert holder("layers.2.mlp.experts", plan) == "layers.2.mlp.experts"
    assert holder("3.router", plan) is None and holder("1.fc", plan) is None


@pytest.mark.parametrize("tp, replicate, what", [
    (2, 2, "tensor parallelism (tp > 1) and HSDP (dp_replicate > 1) together")])
def test_what_expert_parallelism_does_not_run_with_is_named(tp: int, replicate: int,
                                                            what: str) -> None:
    """The worker refuses ep with tensor parallelism and HSDP together before sharing anything
    out, with the words a dry run uses (``experts.check_layout``)."""
    grid = types.SimpleNamespace(ep=2, tp=tp, dp=2, coords={"ep": 0})
    parallel = Parallel(ep=2, tp=tp, ep_plan=em.OWN_PLAN, dp_replicate=replicate)
    with pytest.raises(ConfigError, match=re.escape(f"expert parallelism (ep = 2) with {what} "
                                                    "is not supported yet")):
        parallel.apply_ep({}, grid, ())  # type: ignore[arg-type]
