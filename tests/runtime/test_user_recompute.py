"""Selective recompute of your own model (``flexpipe.Recompute``): the modules it names (by type,
by name pattern, every n-th, some kept) become regions whose saved tensors a forward marked SR
drops and SR recomputes; with dropout (seeded, and drawn from the global generator) the
gradients equal those of the same model without recompute, on one rank, and, in the shared
2-process launch, under 1F1B and ZB-H1 with SR for a model of one's own (torch.fx) and a tiny
Hugging Face Llama checkpointing itself (``gradient_checkpointing_enable()``, torch.export),
against the one-process pipeline without recompute (float64)."""

from __future__ import annotations

from typing import Any

import pytest
import shared_launch
import torch
import user_models as um
from torch import nn
from torch.nn import functional as fn
from torch.utils.checkpoint import CheckpointPolicy

import flexpipe
from flexpipe.errors import ConfigError, RunError
from flexpipe.ir.op import Op
from flexpipe.runtime.execution.executor import Executor
from flexpipe.runtime.execution.handlers import HANDLERS
from flexpipe.runtime.execution.segments import build_graph_stages
from flexpipe.runtime.execution.selective import Selective
from flexpipe.runtime.transport.p2p import P2P
from flexpipe.runtime.user.model import cut_for
from flexpipe.schedules import registry
from flexpipe.schedules.recompute import with_recompute
from flexpipe.sim.validate import check

M, SEED = 2, 5


class MLP(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(fn.dropout(torch.tanh(self.up(x)), 0.2, self.training))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(h), nn.Linear(h, h), MLP(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)  # type: ignore[no-any-return]


class Net(nn.Module):
    """Four blocks of attention (a linear stand-in) and an MLP with dropout."""

    def __init__(self, h: int = 8, n: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(3, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))
        self.out = nn.Linear(h, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)  # type: ignore[no-any-return]


def _loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t).square().mean()


def _batch(n: int = M) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [((torch.randn(2, 3, generator=gen, dtype=torch.float64),),
             torch.randn(2, 2, generator=gen, dtype=torch.float64)) for _ in range(n)]


def _one_rank(rc: flexpipe.Recompute | None, seed: int | None, sr: Any = None,
              ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One step of ``Net`` on one rank under 1F1B (with SR before each backward when ``rc``
    selects regions): its gradients by name, and how many regions each SR redid."""
    torch.manual_seed(0)
    model = Net().double()
    sched = registry.build("1f1b", 1, M)
    cut = cut_for(model, (), _batch()[0][0], sched, recompute=rc)
    if rc is not None:
        sched = with_recompute(sched)
    stages = build_graph_stages(cut.segments, None, 1, graph=sched.graph)
    seen: list[int] = []

    def counting(ex: Executor, op: Op) -> None:
        record = ex.slot(op).selective
        assert isinstance(record, Selective)
        assert all(s.value is None for c in record.calls for s in c.slots)
        seen.append(len(record.calls))
        (sr or HANDLERS["SR"])(ex, op)

    ex = Executor(sched, 0, stages, _loss, P2P([0], 10.0, torch.device("cpu")),
                  dict(HANDLERS, SR=counting), seed=seed)
    torch.manual_seed(11)  # the global generator, for a run without a seed
    ex.step(_batch())
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {names[id(p)]: p.grad for s in stages.values() for p in s.parameters()}
    return grads, seen  # type: ignore[return-value]


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    worst = max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)
    assert worst <= 1e-12, worst


def one_rank_cases() -> dict[str, Any]:
    """Every one-rank case (in the shared one-process launch: the executor's transfer links
    need a process group): gradients and regions per SR, or the error a backward gives."""
    out: dict[str, Any] = {}
    for seed in (SEED, None):
        out[f"plain/{seed}"] = _one_rank(None, seed)
        out[f"mlp/{seed}"] = _one_rank(flexpipe.Recompute(drop=(MLP,)), seed)
    out["pattern"] = _one_rank(flexpipe.Recompute(drop="blocks.*", keep="attn", every=2), SEED)
    for seed in (SEED, None):  # torch's per-op policy: products kept, the rest recomputed
        out[f"ops/{seed}"] = _one_rank(flexpipe.Recompute(drop=MLP, policy=_every_other_mm),
                                       seed)
    out["save_ops"] = _one_rank(flexpipe.Recompute(save_ops=[torch.ops.aten.addmm]), SEED)
    try:
        _one_rank(flexpipe.Recompute(drop="mlp"), SEED, sr=lambda ex, op: None)
        out["no-sr"] = "no error"
    except RunError as exc:
        out["no-sr"] = str(exc)
    return out


def _every_other_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """torchtitan's op-level SAC: every other matrix product of a region saved (counted
    in the forward and again in the recompute)."""
    if op is not torch.ops.aten.addmm.default:
        return CheckpointPolicy.PREFER_RECOMPUTE
    key = "recompute" if ctx.is_recompute else "forward"
    _COUNT[key] = _COUNT.get(key, 0) + 1
    return CheckpointPolicy.MUST_SAVE if _COUNT[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE


_COUNT: dict[str, int] = {}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("seed", [SEED, None])
def test_per_op_policies_are_exact(one_rank: dict[str, Any], seed: int | None) -> None:
    """``Recompute(policy=fn)`` (torch's selective-checkpoint policy) and ``save_ops``."""
    want = one_rank[f"plain/{seed}"][0]
    got, seen = one_rank[f"ops/{seed}"]
    assert seen == [4] * M
    _assert_equal(got, want)
    if seed is not None:
        _assert_equal(one_rank["save_ops"][0], want)


def test_bad_policies_are_named() -> None:
    with pytest.raises(ConfigError, match="is not a torch operator"):
        flexpipe.Recompute(save_ops=["mm"])
    with pytest.raises(ConfigError, match="give one of them"):
        flexpipe.Recompute(policy=_every_other_mm, save_ops=[torch.ops.aten.mm])


@pytest.fixture(scope="module")
def one_rank() -> dict[str, Any]:
    return shared_launch.results(1, "user-recompute")[0]["cases"]  # type: ignore[no-any-return]


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
@pytest.mark.parametrize("seed", [SEED, None])
def test_dropped_mlps_are_recomputed_exactly(one_rank: dict[str, Any], seed: int | None) -> None:
    """With seeded dropout and with the global generator's: the same gradients."""
    want, _ = one_rank[f"plain/{seed}"]
    got, seen = one_rank[f"mlp/{seed}"]
    assert seen == [4] * M  # one region per MLP, dropped until SR
    _assert_equal(got, want)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_patterns_every_and_keep(one_rank: dict[str, Any]) -> None:
    """Blocks 0 and 2 dropped but their attention kept: two regions each (the norm before it,
    the rest after it)."""
    got, seen = one_rank["pattern"]
    assert seen == [4] * M
    _assert_equal(got, one_rank[f"plain/{SEED}"][0])


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_backward_without_sr_fails(one_rank: dict[str, Any]) -> None:
    assert "no SR ran before it" in one_rank["no-sr"]


def test_bad_selections_are_named() -> None:
    with pytest.raises(ConfigError, match="names no module of Net"):
        cut_for(Net(), (), None, registry.build("1f1b", 1, M),
                recompute=flexpipe.Recompute(drop="nothing_here"))
    with pytest.raises(ConfigError, match="every must be a positive"):
        flexpipe.Recompute(drop="mlp", every=0)
    with pytest.raises(ConfigError, match="neither a module name pattern nor a module type"):
        flexpipe.Recompute(drop=(3,))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_sr_goes_before_every_first_backward(name: str) -> None:
    sched = with_recompute(registry.build(name, 2, 4))
    check(sched)
    for ops in sched.ranks:
        for i, op in enumerate(ops):
            if op.kind in ("B", "BW") and Op("SR", op.stage, op.mb) in ops:
                assert ops.index(Op("SR", op.stage, op.mb)) < i
    assert sum(op.kind == "SR" for ops in sched.ranks for op in ops) == 4 * sched.num_stages


def llama_checkpointed(checkpointing: bool) -> nn.Module:
    """A 2-layer Llama with attention dropout, checkpointing its layers itself or not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=um.VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2 * um.SEQ, attention_dropout=0.1,
                      tie_word_embeddings=False)
    model = um.LogitsOf(LlamaForCausalLM(cfg)).double()
    if checkpointing:
        model.lm.gradient_checkpointing_enable()
    return model


def _train(name: str, schedule: str, redo: bool) -> dict[str, torch.Tensor]:
    """One seeded step; this rank's gradients by name."""
    torch.manual_seed(0)
    if name == "net":
        model: nn.Module = Net().double()
        x, y = torch.randn(2 * M, 3, dtype=torch.float64), torch.randn(2 * M, 2,
                                                                        dtype=torch.float64)
        points, loss, rc = ("blocks.2",), _loss, flexpipe.Recompute(drop=MLP) if redo else None
    else:
        model = llama_checkpointed(redo)
        x, y = um.tokens(0, 2 * M)
        points, loss, rc = ("lm.model.layers.1",), um.lm_loss, None
    pipe = flexpipe.pipeline(model, schedule, loss_fn=loss, m=M, seed=SEED, recompute=rc,
                             split_points=points if pipe_ranks() > 1 else (),
                             example=x[:2])
    assert redo == any(op.kind == "SR" for ops in pipe.schedule.ranks for op in ops)
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    return {n: p.grad.detach().clone() for n, p in pipe.named_parameters()
            if p.grad is not None}


def pipe_ranks() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def _names() -> list[str]:
    return ["net", "llama"] if um.installed("transformers") else ["net"]


CASES = [(name, schedule) for name in _names() for schedule in ("1f1b", "zb-h1")]


def rank_main(cases: list[tuple[str, str]], redo: bool) -> list[dict[str, torch.Tensor]]:
    return [_train(name, schedule, redo) for name, schedule in cases]


def reference_main() -> dict[str, Any]:
    """The one-process pipelines without recompute, and the one-rank cases."""
    return {"refs": rank_main([(name, "1f1b") for name in _names()], False),
            "cases": one_rank_cases()}


shared_launch.register(1, "user-recompute", lambda: (reference_main, ()))
shared_launch.register(2, "user-recompute", lambda: (rank_main, (CASES, True)))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_sr_at_two_ranks_equals_one_process_without_recompute() -> None:
    refs = dict(zip(_names(), shared_launch.results(1, "user-recompute")[0]["refs"],
                    strict=True))
    ranks = shared_launch.results(2, "user-recompute")
    for i, (name, schedule) in enumerate(CASES):
        got = {n: g for r in ranks for n, g in r[i].items()}
        assert sorted(got) == sorted(refs[name]), (name, schedule)
        worst = max(float((got[n] - w).norm() / w.norm()) for n, w in refs[name].items())
        assert worst <= 1e-12, (name, schedule, worst)
