"""Hugging Face causal language models on the eager path (``eager.eager_stages``), with the
loss the model computes itself: ``hf_causal_stages(model, split_points, example)`` gives the
stages and ``loss_fn(*outputs, labels)``.

Every stage runs the model's own forward (its masks, positions and rotary tables are made by
it); a stage that is not the first enters the model through ``inputs_embeds``' place: the
embedding is skipped and returns the hidden state received. The last stage returns the
logits, then the batch inputs after ``input_ids`` (an ``attention_mask``), then, for a mixture
of experts with ``output_router_logits=True``, every layer's router logits, gathered stage
after stage (the modules the model records them from, ``_can_record_outputs``), so that the
auxiliary load-balancing loss, which is not a sum over layers, is the model's own:
``loss = model.loss_function(logits, labels) + router_aux_loss_coef * aux``, with the model
family's own ``load_balancing_loss_func``.

Inputs are positional, in the order of the model's forward: ``input_ids``, then optionally
``attention_mask``. The model's key/value cache is turned off (training never reads it).
Families whose embedding is more than one module before the blocks (GPT-2's positions added to
the tokens') are refused by the cut's check; give them as an ``nn.Sequential`` of layers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.user.eager import Collect, EagerModel, eager_stages

LossFn = Callable[..., torch.Tensor]


def hf_causal_stages(model: nn.Module, split_points: Sequence[str], example: object
                     ) -> tuple[EagerModel, LossFn]:
    """The eager stages of a Hugging Face ``...ForCausalLM`` cut at ``split_points``
    (``("model.layers.2",)``) and the model's own loss over their outputs and the labels."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "loss_function"):
        raise ConfigError(f"{type(model).__name__} is not a Hugging Face causal language "
                          "model (it has no config and loss_function)")
    config.use_cache = False
    collect = _router(model) if getattr(config, "output_router_logits", False) else None
    stages = eager_stages(model, split_points, example, collect=collect, finish=_logits)
    return stages, CausalLoss(model, collect is not None)


def _logits(out: Any, rest: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (out.logits, *rest)


def _router(model: nn.Module) -> Collect:
    """The module class whose output the model records as its router logits."""
    for m in model.modules():
        recorder = (getattr(type(m), "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            return Collect(recorder.target_class, recorder.index)
    raise ConfigError(f"{type(model).__name__} has output_router_logits set but records no "
                      "router logits (no _can_record_outputs['router_logits'])")


class CausalLoss:
    """``loss_fn(logits, [attention_mask], [router logits], labels)``: the model's loss."""

    def __init__(self, model: nn.Module, routed: bool) -> None:
        self.model, self.routed = model, routed
        self.balance = getattr(sys.modules[type(model).__module__],
                               "load_balancing_loss_func", None) if routed else None
        if routed and self.balance is None:
            raise ConfigError(f"{type(model).__name__}: its module has no "
                              "load_balancing_loss_func for the router loss")

    def __call__(self, logits: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        """The language-model loss (plus the auxiliary router loss)."""
        *inputs, labels = rest
        router = inputs.pop() if self.routed else None
        model: Any = self.model
        loss = model.loss_function(logits, labels, vocab_size=model.config.vocab_size)
        if router is None:
            return loss  # type: ignore[no-any-return]
        assert self.balance is not None
        mask = inputs[0] if inputs else None
        layers = tuple(router.split(logits.shape[0] * logits.shape[1]))  # one per layer
        aux = self.balance(layers, model.num_experts, model.num_experts_per_tok, mask)
        return loss + model.router_aux_loss_coef * aux  # type: ignore[no-any-return]
