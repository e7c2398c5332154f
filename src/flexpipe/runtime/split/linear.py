"""The split's one fast path: a linear layer whose weight (and bias) are parameters.

``F.linear(x, W, b)`` (``nn.Linear``, an exported ``aten.linear``) and Hugging Face
``Conv1D``'s ``addmm(b, x, W)`` are the products of nearly every transformer. The rule's way
(leaf copies, a kept graph, a second backward in W) costs a reentrant ``autograd.grad`` per
product; here the product runs on the detached weight, so autograd saves and computes only what
dX needs, and a hook on the output hands dY over: W computes ``dW = dY^T X`` and ``db = sum dY``
from the input kept since F, one matrix product per weight, accumulated as autograd
accumulates. ``benchmarks/bw_split.py --path rule`` times the rule's way on the same models
(``ENABLED[0] = False``)."""

from __future__ import annotations

from typing import Any

import torch

from flexpipe.runtime.split.work import WeightWork

ENABLED = [True]
"""Whether the fast path runs (False: every linear through the rule, for the benchmark)."""
LINEAR = {torch._C._nn.linear, torch.ops.aten.linear.default}
ADDMM = {torch.addmm, torch.Tensor.addmm, torch.ops.aten.addmm.default}


def fast(work: WeightWork, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> torch.Tensor | None:
    """The fast path's output for this call, or None where it does not apply (not a linear,
    a weight that is not a parameter or none trainable, an input that carries no graph,
    keywords). Asked before the rule's roles (no graph walk): ``x`` needs no role, as
    whatever its graph reaches gets its gradient in B."""
    if not ENABLED[0] or kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return None
    if func in LINEAR and len(args) >= 2 and not set(kwargs) - {"bias"}:
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        transposed = False
    elif func in ADDMM and len(args) == 3 and not set(kwargs) - {"beta", "alpha"}:
        b, x, w = args
        transposed = True
    else:
        return None
    param = torch.nn.Parameter  # trainable or frozen (a frozen one has nothing for W)
    fits = (isinstance(x, torch.Tensor) and x.requires_grad and isinstance(w, param) and
            (b is None or isinstance(b, param)) and
            (w.requires_grad or (b is not None and b.requires_grad)))
    return _split(work, x, w, b, transposed) if fits else None


def _split(work: WeightWork, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           transposed: bool) -> torch.Tensor:
    """``x W^T + b`` (``x W + b`` when ``transposed``: Conv1D's weight is (in, out)) with
    W's gradient through ``work``."""
    if x.dim() > 2 and not x.is_contiguous():
        x = x.contiguous()  # one product over every row, not a batched one
    xd = x.detach()
    work.kept.append(xd)
    wd, bd = w.detach(), None if b is None else b.detach()
    y = ((torch.mm(x, wd) if bd is None else torch.addmm(bd, x, wd)) if transposed
         else torch._C._nn.linear(x, wd, bd))
    work.note([p for p in (w, b) if p is not None and p.requires_grad])
    y.register_hook(_Hook(work, xd, w, b, transposed))
    return y


class _Hook:
    """On a fast-path output: receives dY in B and leaves W's products (now, outside B)."""

    def __init__(self, work: WeightWork, x: torch.Tensor, w: torch.Tensor,
                 b: torch.Tensor | None, transposed: bool) -> None:
        self.work, self.x, self.w, self.b, self.transposed = work, x, w, b, transposed

    def __call__(self, dy: torch.Tensor) -> None:
        dy = dy.detach()
        if self.work.deferring:
            self.work.defer(lambda: self._wgrad(dy), self.x, dy)
        else:
            with torch.no_grad():
                self._wgrad(dy)

    def _wgrad(self, dy: torch.Tensor) -> None:
        """dW = dY^T X (X^T dY for an (in, out) weight) and db = sum dY, accumulated."""
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), self.x.reshape(-1, self.x.shape[-1])
        if self.w.requires_grad:
            accumulate(self.w, x2.t().mm(dy2) if self.transposed else dy2.t().mm(x2))
        if self.b is not None and self.b.requires_grad:
            accumulate(self.b, dy2.sum(0))


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` as autograd's accumulation does (the first one taken,
    the next added: the same rounding as a fused backward)."""
    if param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)
