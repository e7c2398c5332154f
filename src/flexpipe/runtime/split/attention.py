"""Linear layers inside torch's own Python functions, seen by the split's rule.

``nn.MultiheadAttention`` runs one Python function, ``F.multi_head_attention_forward``; the
rule's mode sees that call, and while it handles it the mode is off, so the input and output
projections inside (``linear``, looked up in ``torch.nn.functional`` at call time) would run
unsplit, or the whole attention would be one product whose W repeats its backward. ``install``
puts ``linear`` there: torch's own ``linear`` whenever the mode is on (the mode then sees the
call) or nothing records, and the split's product while the mode is handling an outer call
(``benchmarks/bw_split.py``'s encoder stages time it)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional as fn

from flexpipe.runtime.split import rule

PLAIN = torch._C._nn.linear
"""torch's own ``F.linear``."""


def linear(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - torch's own name
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, split when a recording's mode is handling an outer call (every linear
    call of the process passes here: one lookup of the recording, then torch's own)."""
    work = rule.current()
    if work is None or torch._C._is_torch_function_mode_enabled() \
            or not torch.is_grad_enabled():
        return PLAIN(input, weight, bias)
    out: Any = rule.split(work, PLAIN, (input, weight, bias), {})
    return out  # type: ignore[no-any-return]


linear.__doc__ = PLAIN.__doc__


def install() -> None:
    """Make ``torch.nn.functional.linear`` this module's (idempotent)."""
    fn.linear = linear  # type: ignore[assignment]
