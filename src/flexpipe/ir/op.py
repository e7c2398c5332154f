"""The smallest unit of a schedule: ``Op(kind, stage, mb)``, printed compactly as ``3F1``."""

from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    """One pass of one micro-batch on one stage. ``kind`` names a registered op kind (F, B, W, ...);
    ``stage`` is the global virtual stage index; ``mb`` the micro-batch index."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def F(stage: int, mb: int) -> Op:
    """Forward pass of ``mb`` on ``stage``."""
    return Op("F", stage, mb)


def B(stage: int, mb: int) -> Op:
    """Input-gradient backward pass of ``mb`` on ``stage``."""
    return Op("B", stage, mb)


def W(stage: int, mb: int) -> Op:
    """Weight-gradient backward pass of ``mb`` on ``stage``."""
    return Op("W", stage, mb)


def BW(stage: int, mb: int) -> Op:
    """Fused full backward (input and weight gradients) of ``mb`` on ``stage``."""
    return Op("BW", stage, mb)


def R(stage: int, mb: int) -> Op:
    """Recompute of ``mb``'s forward activations on ``stage`` before its backward."""
    return Op("R", stage, mb)
