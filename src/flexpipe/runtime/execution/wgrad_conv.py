"""The B/W split of convolutions, transposed or not (``wgrad``'s store): one autograd function
over torch's ``aten.convolution`` whose backward computes the input gradient in B and leaves
the weight and bias gradients (``aten.convolution_backward``) to W; the forwards of
``nn.Conv*`` and ``nn.ConvTranspose*`` that use it while a store records, and a string padding
(``same``, ``valid``) turned into numbers as torch computes it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as fn

from flexpipe.runtime.execution.wgrad import (
    WeightWork,
    accumulate,
    current,
    finish,
    operand,
    owned,
)

Geometry = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool, tuple[int, ...], int]
"""A convolution as ``aten.convolution`` takes it: stride, numeric padding, dilation, whether
transposed, output padding (of a transposed one) and groups."""


class _Conv(torch.autograd.Function):
    """An N-d convolution; backward gives dx, and dW, db now or in W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                work: WeightWork, geom: Geometry) -> torch.Tensor:
        ctx.work, ctx.weight, ctx.bias, ctx.geom = work, weight, bias, geom
        work.note(weight, bias)
        ctx.save_for_backward(x)
        stride, padding, dilation, transposed, extra, groups = geom
        return torch.ops.aten.convolution(  # type: ignore[no-any-return]
            x, weight, bias, list(stride), list(padding), list(dilation), transposed,
            list(extra), groups)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None,
                                                      None]:
        x = ctx.saved_tensors[0].detach()
        weight, bias = ctx.weight, ctx.bias
        stride, padding, dilation, transposed, extra, groups = ctx.geom

        def grads(mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
            return torch.ops.aten.convolution_backward(  # type: ignore[no-any-return]
                dy, x, weight, None if bias is None else list(bias.shape), list(stride),
                list(padding), list(dilation), transposed, list(extra), groups, mask)

        dx = grads([True, False, False])[0] if ctx.needs_input_grad[0] else None
        need_w = ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if need_w or need_b:
            def closure() -> None:
                _, dw, db = grads([False, need_w, need_b])
                if need_w:
                    accumulate(weight, dw)
                if need_b:
                    accumulate(bias, db)
            finish(ctx.work, closure, x, dy)
        return dx, None, None, None, None


def numeric_padding(x: torch.Tensor, padding: str, kernel: tuple[int, ...],
                    dilation: tuple[int, ...], stride: tuple[int, ...]
                    ) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """A convolution's string padding as numbers, as torch computes it: ``valid`` none;
    ``same`` (stride 1) half of ``dilation * (kernel - 1)`` on each side, and where that
    total is odd the input padded by one more at its far end first. Returns the input to
    convolve and the padding of each side; None for what torch refuses too."""
    if padding == "valid":
        return x, (0,) * len(kernel)
    if padding != "same" or any(s != 1 for s in stride):
        return None
    total = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
    if any(t % 2 for t in total):
        x = fn.pad(x, [v for t in reversed(total) for v in (0, t % 2)])
    return x, tuple(t // 2 for t in total)


def conv_forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``nn.Conv1d/2d/3d``'s forward, split while a store records."""
    work, weight, bias = current(), self.weight, self.bias  # read once: maybe computed
    numeric = None if work is None or not owned(weight, bias) else _conv_padding(self, x)
    if work is None or numeric is None:
        return self._conv_forward(x, weight, bias)
    x, padding = numeric
    geom = (tuple(self.stride), padding, tuple(self.dilation), False,
            (0,) * len(padding), self.groups)
    return split_conv(x, weight, bias, work, geom)


def conv_transpose_forward(self: nn.ConvTranspose2d, x: torch.Tensor,
                            output_size: list[int] | None = None) -> torch.Tensor:
    """``nn.ConvTranspose1d/2d/3d``'s forward, split while a store records (zero padding
    given as numbers)."""
    work = current()
    if work is None or self.padding_mode != "zeros" or isinstance(self.padding, str):
        return type(self).forward(self, x, output_size)
    weight, bias = self.weight, self.bias  # read once: a parametrization computes them
    if not owned(weight, bias):
        return type(self).forward(self, x, output_size)
    n = len(self.kernel_size)
    extra = self._output_padding(x, output_size, list(self.stride), list(self.padding),
                                 list(self.kernel_size), n, list(self.dilation))
    geom = (tuple(self.stride), tuple(self.padding), tuple(self.dilation), True,
            tuple(extra), self.groups)
    return split_conv(x, weight, bias, work, geom)


def _conv_padding(conv: nn.Conv2d, x: torch.Tensor
                  ) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """The input a split convolution convolves and its numeric padding (a padding mode
    other than zeros pads the input itself, as the layer does)."""
    if conv.padding_mode != "zeros":
        x = fn.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        return x, (0,) * len(conv.kernel_size)
    if isinstance(conv.padding, str):
        return numeric_padding(x, conv.padding, tuple(conv.kernel_size), tuple(conv.dilation),
                               tuple(conv.stride))
    return x, tuple(conv.padding)


def split_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               work: WeightWork, geom: Geometry) -> torch.Tensor:
    """A convolution, transposed or not (``geom``: ``Geometry``), whose weight gradient goes
    through ``work``."""
    return _Conv.apply(x, operand(weight), operand(bias), work,  # type: ignore[no-any-return]
                       geom)
