"""TensorBoard event files for ``flexpipe run --run-dir`` (torch's ``SummaryWriter``; the
``tensorboard`` package is an optional extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexpipe.errors import ConfigError


def tensorboard_writer(folder: Path, mode: str) -> Any:
    """A ``SummaryWriter`` in ``folder`` (None: ``off``, or ``auto`` without tensorboard)."""
    if mode == "off":
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if mode == "on":
            raise ConfigError("--tensorboard on needs the tensorboard package: pip install "
                              "'flexpipe[tensorboard]'") from None
        return None
    return SummaryWriter(str(folder))
