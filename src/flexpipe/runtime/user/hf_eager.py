"""Hugging Face causal language models on the eager path (``eager.eager_stages``), with the
loss the model computes itself: ``hf_causal_stages(model, split_points, example)`` gives the
stages and ``loss_fn(*outputs, labels)``.

Every stage runs the model's own forward on the batch inputs (its masks, positions and rotary
tables are made by it); a stage that is not the first replaces the embeddings (GPT-2's tokens
and positions alike) by stubs and puts the hidden state it received into its first block's
call. The last stage returns the logits, then the batch inputs after ``input_ids`` (an
``attention_mask``), then, for a mixture
of experts with ``output_router_logits=True``, every layer's router logits, gathered stage
after stage (the modules the model records them from, ``_can_record_outputs``), so that the
auxiliary load-balancing loss, which is not a sum over layers, is the model's own:
``loss = model.loss_function(logits, labels)``, then ``loss += router_aux_loss_coef * aux``
with the model family's own ``load_balancing_loss_func``, as the model's forward does. The
value is the model's own to the bit, in its dtype: Hugging Face computes the language-model
loss in float32 (``logits.float()``, a rounding for a float64 model) and adds the router
loss into it in place, so a float64 model's loss is a float32 number (its gradients are
float64); a sum ``lm + aux`` would be a float64 number 1e-8 away from the model's.

Inputs are positional, in the order of the model's forward: ``input_ids``, then optionally
``attention_mask``. The model's key/value cache is turned off (training never reads it).
Tied input and output embeddings stay one parameter, used by the first and the last stage:
its gradient is the sum of both stages' (the pipeline's ties, as on the traced path).
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


def _logits(out: Any, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (out.logits, *batch[1:])


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
        loss += model.router_aux_loss_coef * aux  # the model's own statement: in its dtype
        return loss  # type: ignore[no-any-return]
