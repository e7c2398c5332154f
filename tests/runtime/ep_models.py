"""Mixtures of experts for the expert-parallel tests, tiny and float64, as chains of layers whose
router output travels with the hidden states, so the router's load-balancing loss is part of the
loss at the last stage: the MoE of one's own of ``flexpipe.runtime.models.moe`` (an
``nn.ModuleList`` of experts, the ``list`` style, each layer's Switch-style balancing term
summed) and Hugging Face's Mixtral, Qwen2-MoE and
DeepSeek-V3 (their own decoder layers, the router logits of every layer concatenated for
Hugging Face's ``load_balancing_loss_func``, as their ``ForCausalLM`` computes it with
``output_router_logits=True``). ``train`` runs one on a rank of ``pp x ep`` against one process
on the whole batch. Importable by the spawned ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.runtime.models import moe
from flexpipe.runtime.transport.engines import full, is_sharded

VOCAB, SEQ, HIDDEN, EXPERTS, TOP_K = 32, 8, 16, 4, 2
AUX = 0.1
"""The load-balancing loss's coefficient (Hugging Face's ``router_aux_loss_coef``)."""


SIZE = moe.MoESize(VOCAB, HIDDEN, EXPERTS, TOP_K, aux=AUX)
MoEBlock = moe.MoEBlock


def own_layers(blocks: int = 4) -> list[nn.Module]:
    """A MoE of one's own (``flexpipe.runtime.models.moe``), float64: embedding, ``blocks`` MoE
    layers, head."""
    return [m.double() for m in moe.layers(dataclasses.replace(SIZE, blocks=blocks))]


OWN_PLAN = moe.PLAN
own_loss = moe.loss(SIZE)
"""Cross-entropy plus the balancing loss."""


class Dense(nn.Module):
    """A residual two-layer MLP before a MoE layer, the dense part tensor parallelism splits
    (``fc`` colwise, ``proj`` rowwise: ``OWN_TP_PLAN``); what follows the hidden states (the
    balancing term) passes through."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, h: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (h + self.proj(fn.gelu(self.fc(h))), *rest)


OWN_TP_PLAN = {"*.fc": "colwise", "*.proj": "rowwise"}
"""The tensor-parallel plan of ``own_tp_layers``: its dense parts split, the experts whole."""


def own_tp_layers(blocks: int = 2) -> list[nn.Module]:
    """The MoE of one's own with a dense part before each MoE layer (float64): embedding,
    ``blocks`` x (``Dense``, MoE layer), head."""
    torch.manual_seed(0)
    size = dataclasses.replace(SIZE, blocks=blocks)
    embed, *moes, head = moe.layers(size, seed=None)
    dense = [Dense(HIDDEN) for _ in moes]
    return [m.double() for m in (embed, *(x for pair in zip(dense, moes, strict=True)
                                          for x in pair), head)]


class RoutedLayer(nn.Module):
    """A Hugging Face decoder layer as a chain layer: hidden states (and the router logits of
    the layers before) in, hidden states and the router logits with this layer's added out;
    the rotary position embeddings computed here."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, carry: bool) -> None:
        super().__init__()
        self.layer, self.rotary = layer, [rotary]  # a list: not a submodule of every layer
        self.carry = carry
        """Whether the router logits travel on (the loss reads them)."""

    def forward(self, h: torch.Tensor, *before: torch.Tensor) -> tuple[torch.Tensor, ...]:
        seen: list[torch.Tensor] = []
        gate = getattr(self.layer.mlp, "gate", None) if self.carry else None
        hook = None if gate is None else gate.register_forward_hook(
            lambda _m, _i, out: seen.append(out[0]))
        pos = torch.arange(h.shape[1], device=h.device)[None]
        try:
            out = self.layer(h, position_embeddings=self.rotary[0](h, pos))
        finally:
            if hook is not None:
                hook.remove()
        out = out[0] if isinstance(out, tuple) else out
        return (out, torch.cat([*before, *seen])) if before or seen else (out,)


class NormHead(nn.Module):
    """The final norm and the language-model head (router logits pass through)."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h: torch.Tensor, *logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.head(self.norm(h)), *logits)


FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("Mixtral", dict(num_local_experts=EXPERTS, intermediate_size=2 * HIDDEN)),
    "qwen2-moe": ("Qwen2Moe", dict(num_experts=EXPERTS, moe_intermediate_size=HIDDEN,
                                   intermediate_size=2 * HIDDEN,
                                   shared_expert_intermediate_size=HIDDEN)),
    "deepseek-v3": ("DeepseekV3", dict(  # latent attention, a dense first layer, no aux loss
        n_routed_experts=EXPERTS, moe_intermediate_size=HIDDEN, intermediate_size=2 * HIDDEN,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1)),
}


def hf_lm(family: str, blocks: int = 4) -> nn.Module:
    """A tiny Hugging Face causal LM of ``family`` (float64, the aux loss on where it has
    one; batched experts: ``grouped_mm`` takes no float64)."""
    import transformers

    prefix, extra = FAMILIES[family]
    cfg = getattr(transformers, f"{prefix}Config")(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=blocks, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, num_experts_per_tok=TOP_K,
        router_aux_loss_coef=AUX, output_router_logits=True, tie_word_embeddings=False,
        experts_implementation="batched_mm", **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{prefix}ForCausalLM")(cfg).double()


def hf_layers(lm: nn.Module) -> list[nn.Module]:
    """``lm`` as a list of layers: embedding, decoder layers (carrying the router logits when
    its loss reads them), head."""
    rotary, carry = lm.model.rotary_emb, _balance(lm) is not None
    return [lm.model.embed_tokens, *(RoutedLayer(b, rotary, carry) for b in lm.model.layers),
            NormHead(lm.model.norm, lm.lm_head)]


def _balance(lm: nn.Module) -> Callable[..., torch.Tensor] | None:
    """The family's ``load_balancing_loss_func`` where its loss adds one."""
    import importlib

    found = getattr(importlib.import_module(type(lm).__module__), "load_balancing_loss_func",
                    None)
    return found if getattr(lm, "num_experts", None) is not None else None


def hf_loss(lm: nn.Module) -> Callable[..., torch.Tensor]:
    """``lm``'s own training loss, in float64: next-token cross-entropy plus its
    ``router_aux_loss_coef`` x ``load_balancing_loss_func`` over every layer's router logits
    (none: DeepSeek-V3, which balances by a bias instead)."""
    cfg, balance, experts = lm.config, _balance(lm), getattr(lm, "num_experts", None)

    def loss(logits: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        *router, labels = rest
        out = fn.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size),
                               labels[:, 1:].reshape(-1))
        if balance is not None and router and experts is not None:
            out = out + cfg.router_aux_loss_coef * balance(tuple(router), experts,
                                                           cfg.num_experts_per_tok)
        return out  # type: ignore[no-any-return]

    return loss


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def chain(layers: Sequence[nn.Module], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One process's forward of a chain of layers (each takes the previous one's tensors)."""
    out: tuple[Any, ...] = (x,)
    for layer in layers:
        out = _as_tuple(layer(*out))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def train(build: Callable[[], tuple[list[nn.Module], Callable[..., torch.Tensor]]],
          schedule: str, plan: dict[str, str] | None, steps: int = 2, m: int = 2,
          overlap: bool = True, final: dict[str, torch.Tensor] | None = None,
          max_norm: float | None = None,
          options: Mapping[str, Any] | None = None) -> dict[str, float]:
    """On one rank of pp 2 x ep 2: ``steps`` SGD steps of the chain ``build()`` gives (layers,
    loss) under ``schedule`` with m micro-batches (``overlap``: its overlapped pairs' passes at
    once), each data replica (the ep ranks) on its half of the batch, against one process on
    the whole batch: the worst relative error of this replica's losses, the first step's
    gradients and the final parameters (an expert's rows or list entries held here against
    the same of the reference); the pairs run at once (``concurrent``); the parameters
    FSDP2 shards over all ``dp x ep`` data replicas (``sharded``; ``hsdp``: those on HSDP's
    2-D mesh), and the experts it shards
    (``sharded_experts``: none, they are left whole). ``final`` receives
    the parameters after the steps; ``max_norm``: both clip their gradients to that total
    norm before each update (``norm``: the worst relative error of the norms). ``options``:
    more of ``flexpipe.pipeline``'s (``fsdp=True``, ``dp=2``: the replicas are then dp x ep;
    a sharded parameter and gradient are compared whole)."""
    import flexpipe

    layers, loss_fn = build()
    ref_layers, ref_loss = build()
    pipe = flexpipe.pipeline(layers, schedule, m=m, ep=2, ep_plan=plan, loss_fn=loss_fn,
                             overlap_pairs=overlap, **(options or {}))
    ref = nn.ModuleList(ref_layers)
    opt = torch.optim.SGD(pipe.param_groups(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0, "losses": 0.0, "norm": 0.0}
    want = dict(ref.named_parameters())
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (8, SEQ), generator=gen)
        target = ids.roll(-1, 1)
        mine = ids.chunk(pipe.dp)[pipe.replica]
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pipe.step(mine if pipe.needs_inputs else None,
                         target.chunk(pipe.dp)[pipe.replica] if pipe.needs_targets else None)
        losses, parts = [], pipe.dp * m
        for part, tgt in zip(ids.chunk(parts), target.chunk(parts), strict=True):
            value = ref_loss(*chain(ref, part), tgt)
            (value / parts).backward()
            losses.append(float(value.detach()))
        if loss is not None:
            own = losses[m * pipe.replica:m * (pipe.replica + 1)]
            errors["loss"] = max(errors["loss"], abs(float(loss) / (sum(own) / m) - 1))
            errors["losses"] += 1
        if max_norm is not None:
            norm = pipe.clip_grad_norm_(max_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
            errors["norm"] = max(errors["norm"], _rel(norm, ref_norm))
        if step == 0:
            errors["grad"] = max(_rel(full(p.grad), _rows(want[n].grad, full(p), pipe))
                                 for n, p in pipe.named_parameters() if p.grad is not None)
        opt.step()
        ref_opt.step()
    errors["param"] = max(_rel(full(p), _rows(want[n], full(p), pipe))
                          for n, p in pipe.named_parameters())
    errors["concurrent"] = float(pipe.worker.executor.pairs.concurrent_runs)
    if final is not None:
        final.update((n, p.detach().clone()) for n, p in pipe.named_parameters())
    experts = {id(p) for shard in pipe.worker.experts for p in shard.params}
    errors["experts"] = float(sum(1 for n, _ in pipe.named_parameters()
                                  if ".experts." in n or n.endswith(("gate_up_proj",
                                                                     "down_proj"))))
    errors["sharded"] = float(sum(1 for p in pipe.parameters() if is_sharded(p)
                                  and p.device_mesh.size() == pipe.dp and id(p) not in experts))
    errors["hsdp"] = float(sum(1 for p in pipe.parameters() if is_sharded(p)
                               and "dp_replicate" in (p.device_mesh.mesh_dim_names or ())
                               and id(p) not in experts))
    errors["sharded_experts"] = float(sum(1 for p in pipe.parameters()
                                          if is_sharded(p) and id(p) in experts))
    errors["split"] = float(sum(1 for p in pipe.parameters() if is_sharded(p)
                                and p.device_mesh.mesh_dim_names == ("tp",)))
    return errors


def train_overlapped(schedule: str, m: int) -> dict[str, float]:
    """``train`` of the MoE of one's own under an overlapped ``schedule``, its pairs' passes at
    once and then one after the other: the first's errors, and ``vs_sequential``, the largest
    difference of the two runs' final parameters (0: the same results)."""
    together: dict[str, torch.Tensor] = {}
    in_turn: dict[str, torch.Tensor] = {}
    out = train(own, schedule, OWN_PLAN, m=m, final=together)
    sequential = train(own, schedule, OWN_PLAN, m=m, overlap=False, final=in_turn)
    out["sequential_concurrent"] = sequential["concurrent"]
    out["vs_sequential"] = max(float((together[n] - in_turn[n]).abs().max()) for n in together)
    return out


def _rows(whole: torch.Tensor, part: torch.Tensor, pipe: Any) -> torch.Tensor:
    """The rows of ``whole`` this rank's ``part`` holds (a stacked expert parameter: this ep
    rank's share of the first dimension; any other: all of it)."""
    if whole.shape == part.shape:
        return whole
    return whole.chunk(pipe.ep)[pipe.ep_rank]


def own() -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
    """The MoE of one's own and its loss."""
    return own_layers(), own_loss


def own_tp() -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
    """The MoE of one's own with dense parts (``own_tp_layers``) and its loss."""
    return own_tp_layers(), own_loss


def tp_layout() -> tuple[list[list[int]], str]:
    """On one rank of pp 2 x ep 2 x tp 2: the global ranks of each lane's ``ep`` group of the
    MoE of one's own with dense parts, and the refusal of a tensor-parallel plan that also
    matches its experts' ``up`` (every rank refuses together)."""
    import torch.distributed as dist

    import flexpipe
    from flexpipe.errors import ConfigError

    common = dict(m=2, ep=2, ep_plan=OWN_PLAN, tp=2, loss_fn=own_loss)
    pipe = flexpipe.pipeline(own_tp_layers(), "1f1b", tp_plan=OWN_TP_PLAN, **common)
    groups = [sorted(dist.get_process_group_ranks(g)) for g in pipe.worker.ep_groups]
    try:
        flexpipe.pipeline(own_tp_layers(), "1f1b", tp_plan={**OWN_TP_PLAN, "*.up": "colwise"},
                          **common)
    except ConfigError as exc:
        return groups, str(exc)
    return groups, ""


def family(name: str) -> Callable[[], tuple[list[nn.Module], Callable[..., torch.Tensor]]]:
    """A builder of Hugging Face family ``name``'s layers and loss (a fresh copy each call)."""

    def build() -> tuple[list[nn.Module], Callable[..., torch.Tensor]]:
        lm = hf_lm(name)
        return hf_layers(lm), hf_loss(lm)

    return build


def _steps(pipe: Any, opt: torch.optim.Optimizer, steps: range, max_norm: float) -> None:
    """SGD steps ``steps`` of the MoE of one's own (the data of ``train``), clipped."""
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (8, SEQ), generator=gen)
        target = ids.roll(-1, 1)
        opt.zero_grad()
        pipe.step(ids.chunk(pipe.dp)[pipe.replica] if pipe.needs_inputs else None,
                  target.chunk(pipe.dp)[pipe.replica] if pipe.needs_targets else None)
        pipe.clip_grad_norm_(max_norm)
        opt.step()


def resumed(schedule: str, folder: str, max_norm: float = 0.5,
            options: Mapping[str, Any] | None = None) -> dict[str, float]:
    """On one rank of pp 2 x ep 2: the MoE of one's own trained 3 clipped steps straight
    through, against 1 step, ``Pipeline.save`` (its sharded experts and SGD state), a new
    pipeline ``load``ing it and 2 more steps: the largest difference of the final parameters
    (``resume``: 0 when they are the same) and the experts saved by this rank. ``options``:
    more of ``flexpipe.pipeline``'s (``fsdp=True``)."""
    import flexpipe

    def fresh() -> tuple[Any, torch.optim.Optimizer]:
        pipe = flexpipe.pipeline(own_layers(), schedule, m=2, ep=2, ep_plan=OWN_PLAN,
                                 loss_fn=own_loss, **(options or {}))
        return pipe, torch.optim.SGD(pipe.param_groups(), lr=0.1, momentum=0.9)

    straight, opt = fresh()
    _steps(straight, opt, range(3), max_norm)
    first, opt = fresh()
    _steps(first, opt, range(1), max_norm)
    first.save(folder, opt)
    again, opt = fresh()
    again.load(folder, opt)
    _steps(again, opt, range(1, 3), max_norm)
    want = straight.full_named_parameters()
    got = again.full_named_parameters()
    return {"resume": max(float((p - want[n]).abs().max()) for n, p in got.items()),
            "experts": float(sum(1 for n, _ in again.named_parameters() if ".experts." in n))}
