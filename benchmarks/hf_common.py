"""What the Hugging Face benchmarks share: the models' size (``Size``; the rank processes read
it from ``$FLEXPIPE_HF_SIZE``), GPT-2 or a Llama at that size as ``ids -> logits``
(``causal_lm``), their loss (``lm_loss``) and their synthetic batches (``token_batch``).
``hf_models.py`` trains them, ``hf_split.py`` times the B/W split on their blocks and
``hf_vs_torch.py`` compares them with torch.distributed.pipelining."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as fn

PREFIX = {"gpt2": "model.transformer.h.", "llama": "model.model.layers."}
SIZE_ENV = "FLEXPIPE_HF_SIZE"
"""The size the rank processes build (JSON of ``Size``): they are spawned, so they read it here."""


@dataclass(frozen=True)
class Size:
    """The models' shape and precision, and how they are cut (``cut``: "auto" or
    "blocks")."""

    hidden: int = 256
    layers: int = 4
    heads: int = 4
    seq: int = 64
    vocab: int = 2048
    micro: int = 4
    dtype: str = "float32"
    cut: str = "auto"


GPU = Size(hidden=2048, layers=4, heads=16, seq=2048, vocab=50257, micro=2, dtype="bfloat16")


def size() -> Size:
    """The size this process builds: ``$FLEXPIPE_HF_SIZE`` or the CPU default."""
    text = os.environ.get(SIZE_ENV)
    return Size(**json.loads(text)) if text else Size()


class Logits(nn.Module):
    """A causal LM as ``ids -> logits``."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.model = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits of ``ids``."""
        return self.model(input_ids=ids, use_cache=False).logits  # type: ignore[no-any-return]


def causal_lm(name: str) -> nn.Module:
    """GPT-2 or Llama at ``size()`` (dropout 0, untied embeddings)."""
    torch.manual_seed(0)
    at = size()
    lm: nn.Module
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        lm = GPT2LMHeadModel(GPT2Config(
            vocab_size=at.vocab, n_positions=at.seq, n_embd=at.hidden, n_layer=at.layers,
            n_head=at.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=False, bos_token_id=at.vocab - 1, eos_token_id=at.vocab - 1))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        lm = LlamaForCausalLM(LlamaConfig(
            vocab_size=at.vocab, hidden_size=at.hidden, intermediate_size=4 * at.hidden,
            num_hidden_layers=at.layers, num_attention_heads=at.heads,
            num_key_value_heads=at.heads, max_position_embeddings=at.seq,
            tie_word_embeddings=False))
    return Logits(lm.to(getattr(torch, at.dtype)))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the micro-batch's tokens."""
    return fn.cross_entropy(logits.flatten(0, 1), target.flatten())


def token_batch(seed: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids of ``micro`` samples (0: ``size().micro``) and the next tokens."""
    at = size()
    ids = torch.randint(0, at.vocab, (micro or at.micro, at.seq + 1),
                        generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]
