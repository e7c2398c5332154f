"""Tiny models people train, for the B/W-split and memory-prediction tests (nothing
downloaded; float64): Hugging Face GPT-2, BERT, ViT, T5 and Llama built from tiny configs, and a
user's CNN with BatchNorm and residual blocks. Each entry of ``MODELS`` gives the module, one
micro-batch of inputs and its target, the loss and the split points of a 2-stage cut."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import user_models as um
from torch import nn
from torch.nn import functional as fn

VOCAB, SEQ, CLASSES = 64, 8, 5


@dataclass(frozen=True)
class Case:
    """A model to split: its builder, an example micro-batch (inputs, target), the loss and
    the split points (module names) of 2 and of 4 stages."""

    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]
    loss: Callable[..., torch.Tensor]
    points2: tuple[str, ...]
    points4: tuple[str, ...]
    eager: Callable[[nn.Module], None] = lambda model: None
    """Makes a copy of the model runnable eagerly by one process, as the reference (the same
    computation in another form where the exported one has no eager kernel)."""


class Logits(nn.Module):
    """A Hugging Face model as ``inputs -> logits`` (its forward takes keywords and returns a
    ``ModelOutput``): ``names`` are the keywords of the positional inputs, ``fixed`` keywords
    every call passes (``use_cache=False``)."""

    def __init__(self, model: nn.Module, *names: str, **fixed: object) -> None:
        super().__init__()
        self.model, self.names, self.fixed = model, names, fixed

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        kw = dict(zip(self.names, inputs, strict=True))
        return self.model(**kw, **self.fixed).logits  # type: ignore[no-any-return]


class ResBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input (a residual), then ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fn.relu(self.b2(self.c2(fn.relu(self.b1(self.c1(x))))) + x)


class CNN(nn.Module):
    """A small ResNet: stem conv + BN, ``depth`` residual blocks, pooled linear head."""

    def __init__(self, c: int = 8, depth: int = 4, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.ModuleList(ResBlock(c) for _ in range(depth))
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fn.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


def cnn() -> nn.Module:
    return CNN().double()


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=2 * SEQ, num_labels=CLASSES,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(BertForSequenceClassification(cfg), "input_ids").double()


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                    num_hidden_layers=4, num_attention_heads=2, intermediate_size=32,
                    num_labels=CLASSES, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return Logits(ViTForImageClassification(cfg), "pixel_values").double()


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2,
                   num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return Logits(T5ForConditionalGeneration(cfg), "input_ids", "decoder_input_ids",
                  use_cache=False).double()


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2 * SEQ, tie_word_embeddings=False)
    return Logits(LlamaForCausalLM(cfg), "input_ids", use_cache=False).double()


def llama_frozen() -> nn.Module:
    """``llama`` fine-tuned in part: its embeddings, first block and every norm frozen
    (``requires_grad`` False), so a 4-stage cut's first stage trains nothing."""
    model = llama()
    for name, p in model.named_parameters():
        if name.startswith(("model.model.embed_tokens.", "model.model.layers.0.")) \
                or "norm" in name:
            p.requires_grad_(False)
    return model


def _mixtral(experts: str | None) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    chosen = {} if experts is None else {"experts_implementation": experts}
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                        num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=2 * SEQ, router_aux_loss_coef=0.0,
                        tie_word_embeddings=False, **chosen)
    return MixtralForCausalLM(cfg)


def mixtral() -> nn.Module:
    """A mixture of experts: 4 experts, 2 per token, in Hugging Face's ``batched_mm`` form
    (each token's expert matrices gathered by id)."""
    return Logits(_mixtral("batched_mm"), "input_ids", use_cache=False).double()


def mixtral_grouped() -> nn.Module:
    """The same mixture of experts as Hugging Face builds it by default: ``grouped_mm``
    experts (tokens sorted by expert, each group times its expert's matrix). Exported, and in
    float64, the product is Hugging Face's ``grouped_mm_fallback`` operation (torch's kernel
    takes no float64); one process in float64 cannot run it eagerly on the CPU."""
    return Logits(_mixtral(None), "input_ids", use_cache=False).double()


def mixtral_kernel() -> nn.Module:
    """``mixtral_grouped`` in bfloat16, as on a GPU: exported, its products are torch's
    ``aten._grouped_mm`` kernel."""
    return Logits(_mixtral(None), "input_ids", use_cache=False).to(torch.bfloat16)


def batched_experts(model: nn.Module) -> None:
    """One process runs the grouped experts of ``mixtral_grouped`` as ``batched_mm`` (the
    same products, row by row): torch's grouped kernel takes no float64 eagerly."""
    model.model.set_experts_implementation("batched_mm")  # type: ignore[operator,union-attr]


def classes_of_tokens(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    gen = torch.Generator().manual_seed(400 + step)
    return (torch.randint(0, VOCAB, (n, SEQ), generator=gen),), \
        torch.randint(0, CLASSES, (n,), generator=gen)


def seq2seq(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)
    dec = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    return (ids, dec[:, :-1]), dec[:, 1:]


def images(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x, y = um.images(step, n)
    return (x,), y


def lm(step: int, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    x, y = um.tokens(step, n)
    return (x,), y


MODELS: dict[str, Case] = {
    "gpt2": Case(um.gpt2, lm, um.lm_loss, ("lm.transformer.h.2",),
                 tuple(f"lm.transformer.h.{i}" for i in (1, 2, 3))),
    "bert": Case(bert, classes_of_tokens, fn.cross_entropy, ("model.bert.encoder.layer.2",),
                 tuple(f"model.bert.encoder.layer.{i}" for i in (1, 2, 3))),
    "vit": Case(vit, images, fn.cross_entropy, ("model.vit.layers.2",),
                tuple(f"model.vit.layers.{i}" for i in (1, 2, 3))),
    "t5": Case(t5, seq2seq, um.lm_loss, ("model.decoder",),
               ("model.encoder.block.1", "model.decoder", "model.decoder.block.1")),
    "llama": Case(llama, lm, um.lm_loss, ("model.model.layers.2",),
                  tuple(f"model.model.layers.{i}" for i in (1, 2, 3))),
    "llama-frozen": Case(llama_frozen, lm, um.lm_loss, ("model.model.layers.2",),
                         tuple(f"model.model.layers.{i}" for i in (1, 2, 3))),
    "mixtral": Case(mixtral, lm, um.lm_loss, ("model.model.layers.2",),
                    tuple(f"model.model.layers.{i}" for i in (1, 2, 3))),
    "mixtral-grouped": Case(mixtral_grouped, lm, um.lm_loss, ("model.model.layers.2",),
                            tuple(f"model.model.layers.{i}" for i in (1, 2, 3)),
                            batched_experts),
    "mixtral-kernel": Case(mixtral_kernel, lm, um.lm_loss, ("model.model.layers.2",),
                           tuple(f"model.model.layers.{i}" for i in (1, 2, 3))),
    "cnn": Case(cnn, images, fn.cross_entropy, ("blocks.2",),
                tuple(f"blocks.{i}" for i in (1, 2, 3))),
}


def cnn_factory() -> object:
    """``flexpipe run --model tiny_models:cnn_factory``: the CNN (16 channels, 4 residual
    blocks), cross-entropy and an example micro-batch of 4 images of 16 x 16."""
    import flexpipe

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 3, 16, 16, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (4,), generator=gen)
    return flexpipe.UserModel(CNN(16, 4).double(), fn.cross_entropy, ((x,), y),
                              split_points=("blocks.2",))


class Segmenter(nn.Module):
    """A fully convolutional net that labels every pixel: ``depth`` residual blocks, a 1 x 1
    convolution to the classes (its target, one class per pixel, is as large as an image)."""

    def __init__(self, c: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.ModuleList(ResBlock(c) for _ in range(depth))
        self.head = nn.Conv2d(c, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fn.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # type: ignore[no-any-return]


def seg_factory() -> object:
    """``--model tiny_models:seg_factory``: the segmenter, per-pixel cross-entropy and an
    example micro-batch of 4 images of 16 x 16 with a class per pixel."""
    import flexpipe

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 3, 16, 16, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (4, 16, 16), generator=gen)
    return flexpipe.UserModel(Segmenter().double(), fn.cross_entropy, ((x,), y),
                              split_points=("blocks.2",))


def gpt2_factory() -> object:
    """``--model tiny_models:gpt2_factory``: the Hugging Face GPT-2 (exported), next-token
    loss, an example micro-batch of 4 sequences, cut at its third block."""
    import flexpipe

    (x,), y = lm(0, 4)
    return flexpipe.UserModel(um.gpt2(), um.lm_loss, ((x,), y),
                              split_points=("lm.transformer.h.2",))
