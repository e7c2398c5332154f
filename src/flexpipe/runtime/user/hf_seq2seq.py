"""Hugging Face encoder-decoder models (T5, BART and their families) on the eager path:
``hf_seq2seq_stages(model, split_points, example)`` gives the stages and
``loss_fn(logits, labels)``, the model's own loss (cross-entropy ignoring -100).

The split points name blocks of the encoder's list and of the decoder's, and must include the
decoder's first block (``("encoder.block.1", "decoder.block.0", "decoder.block.1")`` for T5,
``("model.encoder.layers.1", "model.decoder.layers.0", ...)`` for BART): the encoder's stages
run the model's own encoder forward, its last one handing on the encoder's output; the
decoder's stages run the model's own forward with that output given as ``encoder_outputs``
(so the encoder is skipped there), each owning its decoder blocks. What a block hands the
next one that depends on parameters travels with the hidden state (T5's position bias,
computed by its first block); the encoder's output travels with the batch inputs to every
decoder stage, which sums its gradient over their cross-attentions. A shared embedding (the
encoder's, the decoder's and a tied head's) stays one parameter, its gradient summed over the
stages that use it.

Inputs are positional: ``input_ids``, ``attention_mask``, ``decoder_input_ids`` (from the
labels, ``model.prepare_decoder_input_ids_from_labels(labels=labels)``); targets: the labels.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.user import eager
from flexpipe.runtime.user.interface import as_inputs


def hf_seq2seq_stages(model: nn.Module, split_points: Sequence[str], example: object
                      ) -> tuple[eager.EagerModel, Seq2SeqLoss]:
    """The eager stages of a Hugging Face ``...ForConditionalGeneration`` cut at
    ``split_points`` and the model's own loss over the last one's logits and the labels."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"{type(model).__name__} is not a Hugging Face encoder-decoder "
                          "model (no config with is_encoder_decoder)")
    config.use_cache = False
    inputs = as_inputs(example, "hf_seq2seq_stages: example")
    if len(inputs) != 3:
        raise ConfigError("hf_seq2seq_stages: the example is (input_ids, attention_mask, "
                          f"decoder_input_ids), got {len(inputs)} inputs")
    encoder = model.get_encoder()  # type: ignore[operator]
    at = {id(m): n for n, m in model.named_modules()}[id(encoder)]
    enc_points, dec_points = _split(split_points, at)
    stages = eager.EagerModel(model)
    enc_blocks, enc_starts = _list(encoder, enc_points, at)
    count = len(enc_starts) + len(dec_points) + 1
    stages.extend(eager.part_stages(encoder, enc_blocks, enc_starts, inputs, _encode,
                                    (0, len(enc_starts) + 1), finish=_handed))
    with torch.no_grad():
        held = (_encode(encoder, inputs).last_hidden_state, *inputs)
    dec_blocks = _holder(model, dec_points[0])
    dec_starts = eager.find_blocks(model, dec_points[1:])[1] if dec_points[1:] else []
    stages.extend(eager.part_stages(model, dec_blocks, dec_starts, held, _decode,
                                    (len(enc_starts) + 1, count), finish=_logits))
    eager.check_stages(model, stages, inputs, lambda: (model(
        inputs[0], attention_mask=inputs[1], decoder_input_ids=inputs[2]).logits,))
    return stages, Seq2SeqLoss()


def _split(points: Sequence[str], encoder: str) -> tuple[list[str], list[str]]:
    """The split points in the encoder's list and those in the decoder's (from its block 0)."""
    enc = [p for p in points if p.startswith(f"{encoder}.")]
    dec = [p for p in points if not p.startswith(f"{encoder}.")]
    if not dec or not dec[0].endswith(".0") or list(points) != enc + dec:
        raise ConfigError(f"hf_seq2seq_stages: split points {list(points)} must be the "
                          f"encoder's ({encoder!r}) blocks, then the decoder's first block "
                          "and its later ones (the encoder's last stage ends with it)")
    return enc, dec


def _list(encoder: nn.Module, points: list[str], at: str
          ) -> tuple[Any, list[int]]:
    """The encoder's block list (the paths inside the encoder) and its stages' starts."""
    if points:
        return eager.find_blocks(encoder, [p[len(at) + 1:] for p in points])
    lists = [(n, m) for n, m in encoder.named_children()
             if isinstance(m, nn.ModuleList) and len(m)]
    if len(lists) != 1:
        raise ConfigError(f"hf_seq2seq_stages: the encoder {at!r} has no single list of "
                          "blocks")
    return lists[0], []


def _holder(model: nn.Module, point: str) -> Any:
    """The block list holding ``point`` (the decoder's block 0)."""
    parent = point.rpartition(".")[0]
    holder = dict(model.named_modules()).get(parent)
    if not isinstance(holder, nn.ModuleList | nn.Sequential):
        raise ConfigError(f"split point {point!r}: not a block of an nn.ModuleList of "
                          f"{type(model).__name__}")
    return parent, holder


def _encode(encoder: nn.Module, batch: tuple[torch.Tensor, ...]) -> Any:
    return encoder(input_ids=batch[0], attention_mask=batch[1])


def _handed(out: Any, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The encoder's last stage: its output, then the batch inputs."""
    return (out.last_hidden_state, *batch)


def _decode(model: nn.Module, held: tuple[torch.Tensor, ...]) -> Any:
    encoded, _, mask, decoder_ids = held
    return model(attention_mask=mask, decoder_input_ids=decoder_ids, encoder_outputs=(encoded,))


def _logits(out: Any, _batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (out.logits,)


class Seq2SeqLoss:
    """``loss_fn(logits, labels)``: T5's and BART's own (cross-entropy ignoring -100)."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the tokens whose label is not -100."""
        return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                           labels.reshape(-1), ignore_index=-100)
