"""Models for the eager-path tests, tiny and float64, without dropout: one of one's own whose
blocks branch on values (``Branchy``), Hugging Face causal language models (Qwen2-MoE and
Mixtral returning their router logits, Llama and GPT-2 with tied input and output
embeddings) and encoder-decoders (T5, BART). ``CASES[name](points)`` gives the model, its
eager stages, the loss, the batch inputs and the targets of a batch of ``2 * M`` samples;
``POINTS[name][schedule]`` the split points. Importable by the spawned ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flexpipe.runtime.user.eager import eager_stages

M = 4
"""Micro-batches per step."""
V = 32
"""Vocabulary of the language models."""


class Block(nn.Module):
    """A block whose branch depends on its input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.mean() > 0:
            return h + torch.tanh(self.a(h))
        return h - torch.relu(self.b(h))


class Branchy(nn.Module):
    """Embedding, blocks with data-dependent branches, norm and head."""

    def __init__(self, residual: bool = False) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.norm, self.residual = nn.LayerNorm(8), residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h) if self.residual else block(h)
        return self.head(self.norm(h))


def _lm(kind: str, experts: bool = False, **extra: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, **extra)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).double()
    if experts:
        model.model.set_experts_implementation("batched_mm")  # grouped_mm takes no float64
    return model


def qwen_moe() -> nn.Module:
    """Qwen2-MoE with a shared expert, returning its router logits."""
    return _lm("Qwen2Moe", True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=16, router_aux_loss_coef=0.1,
               output_router_logits=True, tie_word_embeddings=False)


def mixtral() -> nn.Module:
    """Mixtral returning its router logits."""
    return _lm("Mixtral", True, num_local_experts=4, num_experts_per_tok=2,
               router_aux_loss_coef=0.1, output_router_logits=True)


def llama_tied() -> nn.Module:
    """Llama whose output head is its input embedding."""
    return _lm("Llama", tie_word_embeddings=True)


def gpt2() -> nn.Module:
    """GPT-2 (Conv1D layers, learned positions, tied head)."""
    import transformers

    cfg = transformers.GPT2Config(vocab_size=V, n_embd=16, n_layer=4, n_head=2, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).double()


def t5() -> nn.Module:
    """T5 (relative position bias from its first blocks, tied head scaled)."""
    import transformers

    cfg = transformers.T5Config(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                                num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).double()


def bart() -> nn.Module:
    """BART (learned positions, embedding layer norms)."""
    import transformers

    cfg = transformers.BartConfig(
        vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    return transformers.BartForConditionalGeneration(cfg).double()


Case = tuple[nn.Module, nn.Module, Callable[..., torch.Tensor], tuple[torch.Tensor, ...],
             torch.Tensor]


def branchy_case(points: tuple[str, ...]) -> Case:
    """The model with data-dependent branches."""
    model = Branchy().double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2 * M, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * M,), generator=gen)
    return model, eager_stages(model, points, x[:2]), nn.functional.cross_entropy, (x,), y


def causal_case(build: Callable[[], nn.Module]) -> Callable[[tuple[str, ...]], Case]:
    """A causal language model through ``hf_causal_stages``."""
    def make(points: tuple[str, ...]) -> Case:
        from flexpipe.runtime.user.hf_eager import hf_causal_stages

        model = build()
        ids = torch.randint(0, V, (2 * M, 8), generator=torch.Generator().manual_seed(5))
        stages, loss = hf_causal_stages(model, points, (ids[:2],))
        return model, stages, loss, (ids,), ids
    return make


def seq2seq_case(build: Callable[[], nn.Module]) -> Callable[[tuple[str, ...]], Case]:
    """An encoder-decoder through ``hf_seq2seq_stages``, over padded inputs and labels."""
    def make(points: tuple[str, ...]) -> Case:
        from flexpipe.runtime.user.hf_seq2seq import hf_seq2seq_stages

        model = build()
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(3, V, (2 * M, 7), generator=gen)
        mask = torch.ones_like(ids)
        mask[1::2, 5:] = 0
        labels = torch.randint(3, V, (2 * M, 5), generator=gen)
        labels[::3, 4] = -100
        dec = model.prepare_decoder_input_ids_from_labels(labels=labels)  # type: ignore[operator]
        stages, loss = hf_seq2seq_stages(model, points, (ids[:2], mask[:2], dec[:2]))
        return model, stages, loss, (ids, mask, dec), labels
    return make


CASES: dict[str, Callable[[tuple[str, ...]], Case]] = {
    "branchy": branchy_case, "qwen2-moe": causal_case(qwen_moe),
    "mixtral": causal_case(mixtral), "llama-tied": causal_case(llama_tied),
    "gpt2": causal_case(gpt2), "t5": seq2seq_case(t5), "bart": seq2seq_case(bart)}

_CHAIN = {"1f1b": (2,), "zb-h1": (2,), "zb-v": (1, 2, 3)}


def _at(where: str) -> dict[str, tuple[str, ...]]:
    return {s: tuple(f"{where}.{i}" for i in cut) for s, cut in _CHAIN.items()}


def _encdec(enc: str, dec: str) -> dict[str, tuple[str, ...]]:
    two = (f"{dec}.0",)
    return {"1f1b": two, "zb-h1": two, "zb-v": (f"{enc}.1", f"{dec}.0", f"{dec}.1")}


POINTS: dict[str, dict[str, tuple[str, ...]]] = {
    "branchy": _at("blocks"), "qwen2-moe": _at("model.layers"), "mixtral": _at("model.layers"),
    "llama-tied": _at("model.layers"), "gpt2": _at("transformer.h"),
    "t5": _encdec("encoder.block", "decoder.block"),
    "bart": _encdec("model.encoder.layers", "model.decoder.layers")}
"""Split points per model and schedule (2 stages, ZB-V's 4)."""
