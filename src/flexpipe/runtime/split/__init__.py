"""The B/W split: one rule for every product of an activation and a weight (``rule``), one
micro-batch's work from B to W (``work``), the linear layers' fast path (``linear``), and how
much of a stage's weights W handles (``recorded_share``, ``notice``). docs/architecture.md,
"The B/W split", explains it."""

from __future__ import annotations

import warnings

from torch import nn

from flexpipe.runtime.split import attention
from flexpipe.runtime.split.rule import current, recording
from flexpipe.runtime.split.work import WeightWork

attention.install()

__all__ = ["SplitNotice", "WeightWork", "current", "notice", "recorded_share", "recording"]


class SplitNotice(UserWarning):
    """A stage's weights whose gradient stays in B (read outside any product the split
    knows): correct, not deferred."""


def recorded_share(module: nn.Module, work: WeightWork) -> float:
    """Fraction of ``module``'s trainable parameter elements whose gradient ``work`` (one
    micro-batch's forward, recorded) leaves to W."""
    params = {id(p): p.numel() for p in module.parameters() if p.requires_grad}
    total = sum(params.values())
    done = sum(params[i] for i in work.deferred if i in params)
    return done / total if total else 1.0


def notice(stage: int, module: nn.Module, work: WeightWork) -> None:
    """Warn (a ``SplitNotice``) naming the modules of a stage whose trainable matrices (two or
    more dimensions) ``work``, its split micro-batch, leaves in B."""
    names = [name or type(module).__name__ for name, sub in module.named_modules()
             if any(p.requires_grad and p.dim() >= 2 and id(p) not in work.deferred
                    for p in sub.parameters(recurse=False))]
    if names:
        warnings.warn(SplitNotice(
            f"stage {stage}: the weight gradients of {', '.join(names[:6])}"
            f"{' and more' if len(names) > 6 else ''} stay in B ({recorded_share(module, work):.0%}"
            " of the stage's weights are deferred to W): they are read outside the products "
            "the split knows (flexpipe.runtime.split.rule.PRODUCTS)"), stacklevel=2)
