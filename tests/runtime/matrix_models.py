"""The models people train, built tiny in the test (nothing downloaded), float64, for the model
matrix (``test_model_matrix.py``): Hugging Face GPT-2 with tied embeddings, Llama, Qwen2 (tied),
BERT with an attention mask, T5 (encoder and decoder share one embedding, tied to the head), a
ViT, a Mixtral mixture of experts, and a CNN of one's own with BatchNorm and a long residual.

Each entry builds the model with one block per pipeline stage, names its split points and
makes micro-batch data; Hugging Face models take keyword inputs with ``labels`` and compute
their own loss, the CNN takes a tensor and a ``loss_fn``. Importable by the spawned ranks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

VOCAB, SEQ, HIDDEN = 48, 8, 16
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Entry:
    """One model: ``build(stages)`` -> module, ``points(stages)`` -> split points,
    ``data(step, n)`` -> keyword inputs (with labels) or ``{"x": ..., "y": ...}``, and the
    loss of models that do not compute their own (None: they do)."""

    build: Callable[[int], nn.Module]
    points: Callable[[int], tuple[str, ...]]
    data: Callable[[int, int], Batch]
    loss_fn: Callable[..., torch.Tensor] | None = None


def _tokens(step: int, n: int, mask: bool = False) -> Batch:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=gen)
    out = {"input_ids": ids, "labels": torch.randint(1, VOCAB, (n, SEQ), generator=gen)}
    if mask:
        keep = torch.ones(n, SEQ, dtype=torch.long)
        keep[::2, SEQ - 3:] = 0
        out["attention_mask"] = keep
    return out


def _classes(step: int, n: int) -> Batch:
    gen = torch.Generator().manual_seed(2000 + step)
    out = _tokens(step, n, mask=True)
    out["labels"] = torch.randint(0, 3, (n,), generator=gen)
    return out


def _images(step: int, n: int) -> Batch:
    gen = torch.Generator().manual_seed(3000 + step)
    return {"pixel_values": torch.randn(n, 3, 8, 8, generator=gen, dtype=torch.float64),
            "labels": torch.randint(0, 3, (n,), generator=gen)}


def _cnn_data(step: int, n: int) -> Batch:
    gen = torch.Generator().manual_seed(4000 + step)
    return {"x": torch.randn(n, 3, 8, 8, generator=gen, dtype=torch.float64),
            "y": torch.randint(0, 3, (n,), generator=gen)}


def gpt2(stages: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=HIDDEN, n_layer=stages,
                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg).double()


def llama(stages: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=stages, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2 * SEQ)
    return LlamaForCausalLM(cfg).double()


def qwen2(stages: int) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=stages, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2 * SEQ, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).double()


def bert(stages: int) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=stages,
                     num_attention_heads=2, intermediate_size=2 * HIDDEN,
                     max_position_embeddings=2 * SEQ, num_labels=3, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg).double()


def t5(stages: int) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    half = stages // 2
    cfg = T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=2 * HIDDEN, num_layers=half,
                   num_decoder_layers=stages - half, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    return T5ForConditionalGeneration(cfg).double()


def vit(stages: int) -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=HIDDEN,
                    num_hidden_layers=stages, num_attention_heads=2, intermediate_size=2 * HIDDEN,
                    num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg).double()


def mixtral(stages: int) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                        num_hidden_layers=stages, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=2 * SEQ, router_aux_loss_coef=0.0,
                        experts_implementation="batched_mm")  # grouped_mm has no float64
    return MixtralForCausalLM(cfg).double()


class CNN(nn.Module):
    """conv-BN stem, one conv-BN block per stage after the first, a head reading the stem's
    output too (a long residual over every stage)."""

    def __init__(self, stages: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            for _ in range(stages - 1))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        g = h
        for block in self.blocks:
            g = block(g)
        return self.head((g + h).mean(dim=(2, 3)))  # type: ignore[no-any-return]


def cnn(stages: int) -> nn.Module:
    return CNN(stages).double()


def _layers(prefix: str, first: int = 1) -> Callable[[int], tuple[str, ...]]:
    return lambda stages: tuple(f"{prefix}{k}" for k in range(first, stages + first - 1))


def _t5_points(stages: int) -> tuple[str, ...]:
    half = stages // 2
    return (*(f"encoder.block.{k}" for k in range(1, half)),
            *(f"decoder.block.{k}" for k in range(stages - half)))


MODELS: dict[str, Entry] = {
    "gpt2-tied": Entry(gpt2, _layers("transformer.h."), _tokens),
    "llama": Entry(llama, _layers("model.layers."), _tokens),
    "qwen2-tied": Entry(qwen2, _layers("model.layers."), _tokens),
    "bert-mask": Entry(bert, _layers("bert.encoder.layer."), _classes),
    "t5-shared": Entry(t5, _t5_points, lambda s, n: _tokens(s, n, mask=True)),
    "vit": Entry(vit, _layers("vit.layers."), _images),
    "mixtral": Entry(mixtral, _layers("model.layers."), _tokens),
    "cnn-bn": Entry(cnn, _layers("blocks.", 0), _cnn_data, fn.cross_entropy),
}


def split_batch(entry: Entry, batch: Batch) -> tuple[dict[str, Any], Any]:
    """(keyword inputs, targets) of a batch: a model with its own loss takes everything as
    inputs; the CNN takes ``x`` and its loss the targets ``y``."""
    if entry.loss_fn is None:
        return batch, None
    return {"x": batch["x"]}, batch["y"]


def under_dp(name: str, schedule: str, stages: int, steps: int,
             options: dict[str, Any] | None = None) -> float:
    """On one rank of pp 2 x dp 2: model ``name`` cut into ``stages``, ``steps`` SGD steps
    under ``schedule`` (generator ``options``), each replica on its half of the batch
    (own-loss models); the worst relative error of the parameters (whole tensors: FSDP shards
    gathered) against one process on the whole batch."""
    import copy

    import flexpipe

    entry = MODELS[name]
    torch.manual_seed(0)
    model = entry.build(stages)
    ref = copy.deepcopy(model)
    example, _ = split_batch(entry, entry.data(0, 2))
    pipe = flexpipe.pipeline(model, schedule, m=2, dp=2, split_points=entry.points(stages),
                             example=example, **(options or {}))
    opt = torch.optim.SGD(pipe.param_groups(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    return worst_against_one_process(pipe, ref, entry, steps, opt, ref_opt)


def worst_against_one_process(pipe: Any, ref: Any, entry: Any, steps: int, opt: Any,
                              ref_opt: Any) -> float:
    """``steps`` optimizer steps of ``pipe`` (pp 2 x dp 2, each replica on its half of the
    batch) and of ``ref`` (one process, the whole batch as four micro-batches): the worst
    relative error of the parameters (whole tensors: FSDP shards gathered)."""
    for step in range(steps):
        batch = entry.data(step, 8)
        mine = {k: v.chunk(2)[pipe.replica] for k, v in batch.items()}
        opt.zero_grad()
        ref_opt.zero_grad()
        pipe.step(**(mine if pipe.needs_inputs else {}))
        for part in zip(*(v.chunk(4) for v in batch.values()), strict=True):
            # every replica's micro-batches, each loss over all four
            (ref(**dict(zip(batch, part, strict=True))).loss / 4).backward()
        opt.step()
        ref_opt.step()
    want = dict(ref.named_parameters())
    return max(float((q - want[n]).norm() / want[n].norm().clamp_min(1e-12))
               for n, q in pipe.full_named_parameters().items())


LLAMA_TP_PLAN = {"*.self_attn.q_proj": "colwise", "*.self_attn.k_proj": "colwise",
                 "*.self_attn.v_proj": "colwise", "*.self_attn.o_proj": "rowwise",
                 "*.mlp.gate_proj": "colwise", "*.mlp.up_proj": "colwise",
                 "*.mlp.down_proj": "rowwise"}
"""Megatron's split of a Hugging Face Llama decoder layer, in its module names."""


class DecoderLayer(nn.Module):
    """A Hugging Face decoder layer as a chain layer: hidden states in, hidden states out, the
    rotary position embeddings computed here (the model's rotary module has no parameters)."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, [rotary]  # a list: not a submodule of every layer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(h.shape[1], device=h.device)[None]
        out = self.layer(h, position_embeddings=self.rotary[0](h, pos))
        return out[0] if isinstance(out, tuple) else out


class NormHead(nn.Module):
    """The final norm and the language-model head."""

    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))  # type: ignore[no-any-return]


def llama_layers(blocks: int = 4) -> list[nn.Module]:
    """A tiny Hugging Face Llama (4 heads, 2 key-value heads, float64) as a list of layers:
    its embedding, its decoder layers and its norm + head (what tensor parallelism splits:
    the layers' own ``nn.Linear`` modules, whose attention counts heads from the features)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                      num_hidden_layers=blocks, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2 * SEQ)
    lm = LlamaForCausalLM(cfg).double()
    rotary = lm.model.rotary_emb
    return [lm.model.embed_tokens, *(DecoderLayer(block, rotary) for block in lm.model.layers),
            NormHead(lm.model.norm, lm.lm_head)]
