"""The random-number state a checkpoint saves with its stages: this process's torch and Python
generators, as plain data (tensors, lists, ints) that ``torch.load(weights_only=True)`` reads
back."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's torch and Python RNG states, as plain data (tensors, lists, ints)."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))

