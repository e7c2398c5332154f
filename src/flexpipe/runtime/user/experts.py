"""The built-in expert-parallel plans of Hugging Face's mixture-of-experts families (the
installed transformers' modeling code): the family's decoder layer holds its MoE block as
``mlp``, whose ``experts`` module keeps every expert's matrices stacked (``gate_up_proj``,
``down_proj``: experts along the first dimension) and takes ``(hidden, top_k_index,
top_k_weights)`` from the router (``flexpipe.runtime.transport.experts``). A family's dense
layers (DeepSeek-V3's first layers, Qwen2-MoE's ``mlp_only_layers``) have no ``mlp.experts``
and stay as they are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from torch import nn

FAMILY_PLANS: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "mixtral": {"*mlp.experts": "stacked"},
    "qwen2_moe": {"*mlp.experts": "stacked"},
    "deepseek_v3": {"*mlp.experts": "stacked"},
})
"""Hugging Face ``config.model_type`` -> its expert-parallel plan."""


def family_plan(model: nn.Module | Sequence[nn.Module]) -> dict[str, str]:
    """The built-in plan of the Hugging Face MoE family ``model`` (or one of its layers) comes
    from (its modules' ``config.model_type``); empty for any other model."""
    modules = [model] if isinstance(model, nn.Module) else list(model)
    for root in modules:
        for sub in root.modules():
            kind = getattr(getattr(sub, "config", None), "model_type", None)
            if isinstance(kind, str) and kind in FAMILY_PLANS:
                return dict(FAMILY_PLANS[kind])
    return {}
