"""The random-number state a checkpoint saves: this process's torch and Python generators, as
plain data (tensors, lists, ints) that ``torch.load(weights_only=True)`` reads back
(``rng_state``), or as JSON (``as_json``: the torch state as base64 text) for a DCP
checkpoint's manifest, one entry per rank."""

from __future__ import annotations

import base64
import random
from collections.abc import Mapping
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """This process's torch and Python RNG states, as plain data (tensors, lists, ints)."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` (or ``from_json``) returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def as_json(state: Mapping[str, Any]) -> dict[str, Any]:
    """``rng_state()`` as JSON data."""
    raw = state["torch"].numpy().tobytes()
    return {"torch": base64.b64encode(raw).decode("ascii"), "python": state["python"]}


def from_json(data: Mapping[str, Any]) -> dict[str, Any]:
    """What ``as_json`` wrote, back as ``rng_state`` data."""
    raw = bytearray(base64.b64decode(data["torch"], validate=True))
    return {"torch": torch.frombuffer(raw, dtype=torch.uint8).clone(),
            "python": list(data["python"])}
