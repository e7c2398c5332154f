"""Graphs that follow their module to another device.

``torch.export`` records the device of every tensor a model creates (``aten.arange(...,
device=cpu)`` for positions and causal masks, ``aten.to(..., device=cpu)``, the metadata
asserts), so a model exported on the CPU and moved to a GPU would build those tensors on the CPU
and fail or copy back and forth. ``retarget`` rewrites a module's graphs for the device it now
computes on: every device constant of another device, and every tensor constant the graphs hold
outside their parameters and buffers. ``TracedStage`` calls it before the first forward on a new
device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn


def _stale(value: Any, device: torch.device) -> bool:
    """Whether ``value`` holds a ``torch.device`` other than ``device``."""
    if isinstance(value, torch.device):
        return value != device
    if isinstance(value, tuple | list):
        return any(_stale(v, device) for v in value)
    if isinstance(value, dict):
        return any(_stale(v, device) for v in value.values())
    return False


def _moved(value: Any, device: torch.device) -> Any:
    """``value`` with every ``torch.device`` in it replaced by ``device``."""
    if isinstance(value, torch.device):
        return device
    if isinstance(value, tuple | list):
        return type(value)(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def _constants(gm: fx.GraphModule, device: torch.device) -> None:
    """Move the graph's plain tensor attributes (not parameters or buffers) to ``device``."""
    owned = {id(t) for t in gm.parameters(recurse=False)} | {
        id(t) for t in gm.buffers(recurse=False)}
    for name, value in list(vars(gm).items()):
        if isinstance(value, torch.Tensor) and id(value) not in owned \
                and value.device != device:
            setattr(gm, name, value.to(device))


def retarget(module: nn.Module, device: torch.device) -> int:
    """Rewrite every graph inside ``module`` to create its tensors on ``device``; the number of
    node arguments changed."""
    changed = 0
    for gm in module.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if _stale(node.args, device) or _stale(node.kwargs, device):
                node.args = _moved(node.args, device)
                node.kwargs = _moved(node.kwargs, device)
                changed += 1
        _constants(gm, device)
        gm.recompile()
    return changed


def compute_device(module: nn.Module, inputs: tuple[Any, ...]) -> torch.device | None:
    """Where ``module`` computes: its first parameter's or buffer's device, else its first
    tensor input's (None: neither)."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return None
