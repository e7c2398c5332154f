"""Which weights of a stage W computes, and making a stage split its backward: ``prepare``
gives every layer in ``SPLIT_FORWARDS`` (by type) or ``wgrad_aten.NAMED_FORWARDS`` (by
class name, e.g. Hugging Face's ``Conv1D``) its split forward and every graph of operations
inside the stage (torch.fx, torch.export) its deferring products (``wgrad_aten.rewrite``);
``deferred_share`` / ``recorded_share`` say how much of a stage's weights W handles. It sits
above ``wgrad`` (the store), the layers' split forwards (``wgrad_layers``, ``wgrad_conv``,
``wgrad_bag``, ``wgrad_rnn``) and ``wgrad_aten`` (the graph rules), which import nothing of
it."""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from flexpipe.runtime.execution import wgrad_bag, wgrad_conv, wgrad_layers, wgrad_rnn
from flexpipe.runtime.execution.wgrad import WeightWork
from flexpipe.runtime.execution.wgrad_aten import NAMED_FORWARDS, rewrite

SPLIT_FORWARDS: Mapping[type, Callable[..., Any]] = {
    nn.Linear: wgrad_layers.linear_forward,
    nn.modules.linear.NonDynamicallyQuantizableLinear: wgrad_layers.linear_forward,
    nn.Conv1d: wgrad_conv.conv_forward,
    nn.Conv2d: wgrad_conv.conv_forward,
    nn.Conv3d: wgrad_conv.conv_forward,
    nn.ConvTranspose1d: wgrad_conv.conv_transpose_forward,
    nn.ConvTranspose2d: wgrad_conv.conv_transpose_forward,
    nn.ConvTranspose3d: wgrad_conv.conv_transpose_forward,
    nn.Embedding: wgrad_layers.embedding_forward,
    nn.EmbeddingBag: wgrad_bag.bag_forward,
    nn.MultiheadAttention: wgrad_layers.mha_forward,
    nn.LSTM: wgrad_rnn.lstm_forward,
    nn.GRU: wgrad_rnn.gru_forward,
}
"""The one table: layer type (exactly; a subclass may compute otherwise) -> its split forward."""


def _split_forward(sub: nn.Module) -> Callable[..., Any] | None:
    """The split forward of a layer: by its type, or by its class's qualified name (a
    library's layer, e.g. Hugging Face's ``Conv1D``, without importing the library)."""
    kind = parametrize.type_before_parametrizations(sub)  # a parametrized layer: its own
    return SPLIT_FORWARDS.get(kind) or NAMED_FORWARDS.get(f"{kind.__module__}.{kind.__qualname__}")


def prepare(module: nn.Module) -> nn.Module:
    """Give every layer of ``module`` whose type is in ``SPLIT_FORWARDS`` (or whose class is
    in ``wgrad_aten.NAMED_FORWARDS``) its split forward, and every graph inside it (torch.fx,
    torch.export) deferring products (``wgrad_aten.rewrite``); idempotent, and without an
    active ``recording`` everything computes exactly as before."""
    for sub in module.modules():
        split = _split_forward(sub)
        if split is not None and getattr(sub.forward, "__func__", None) is not split:
            sub.forward = types.MethodType(split, sub)  # type: ignore[method-assign]
    rewrite(module)
    return module


def deferred_params(module: nn.Module) -> list[torch.Tensor]:
    """The parameters of ``module``'s split layers (by type or name), whose gradient W computes
    (for graphs of operations, ask a recorded micro-batch: ``recorded_share``)."""
    out: list[torch.Tensor] = []
    for sub in module.modules():
        if _split_forward(sub) is not None:
            out += [p for name, p in sub.named_parameters() if p.requires_grad
                    and ("." not in name or name.startswith("parametrizations."))]
    return out


def deferred_share(module: nn.Module) -> float:
    """Fraction of ``module``'s trainable parameter elements in its split layers."""
    return _share(module, deferred_params(module))


def recorded_share(module: nn.Module, work: WeightWork) -> float:
    """Fraction of ``module``'s trainable parameter elements whose gradient ``work`` (one
    micro-batch's forward, recorded) leaves to W: the ``deferred_share`` of any model,
    graphs of operations included."""
    return _share(module, list(work.deferred.values()))


def _share(module: nn.Module, deferred: list[torch.Tensor]) -> float:
    params = {id(p): p.numel() for p in module.parameters() if p.requires_grad}
    total = sum(params.values())
    done = sum(params[i] for i in {id(p) for p in deferred} if i in params)
    return done / total if total else 1.0
