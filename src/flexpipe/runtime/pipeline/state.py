"""A ``Pipeline``'s state under your model's own names: this rank's parameters and buffers
(``state_dict``/``load_state_dict``, ``named_buffers``), the names its checkpoints are keyed by
(``Pipeline.save``/``load`` write and read them through ``flexpipe.runtime.processes.dcp``,
the one DCP format, so that a checkpoint written at p = 2 loads at p = 4 exactly)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.processes.dcp import few
from flexpipe.runtime.transport.engines import assign

Named = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class BufferNames:
    """Your model's buffers: ``names`` id(buffer) -> its name (the first, where a buffer has
    several), and which names are ``persistent`` (in ``state_dict``: BatchNorm's running
    statistics are, a rotary embedding's ``inv_freq`` usually is not); ``state_keys``: every
    name of your model's ``state_dict``, a tied weight's other names included."""

    names: dict[int, str] = field(default_factory=dict)
    persistent: frozenset[str] = frozenset()
    state_keys: frozenset[str] = frozenset()


def buffer_names(model: nn.Module | Iterable[nn.Module]) -> BufferNames:
    """The ``BufferNames`` of ``model`` (a module, or a list of layers)."""
    root = model if isinstance(model, nn.Module) else nn.ModuleList(model)
    names: dict[int, str] = {}
    for name, b in root.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), name)
    kept = root.state_dict(keep_vars=True)
    return BufferNames(names, frozenset(n for n in names.values() if n in kept),
                       frozenset(kept))


def rank_buffers(stages: Mapping[int, nn.Module], buffers: BufferNames) -> Iterator[
        tuple[str, torch.Tensor]]:
    """This rank's buffers of your model under their names, each once (tensors a traced stage
    made itself, which are not your model's, are left out)."""
    seen: set[int] = set()
    for stage in stages.values():
        for _, b in stage.named_buffers(remove_duplicate=False):
            if id(b) in buffers.names and id(b) not in seen:
                seen.add(id(b))
                yield buffers.names[id(b)], b


def collect(params: Named, buffers: Named, persistent: frozenset[str]) -> dict[str, torch.Tensor]:
    """Name -> tensor (detached, sharing storage) of the parameters and persistent buffers."""
    out = {name: p.detach() for name, p in params}
    out.update((name, b.detach()) for name, b in buffers if name in persistent)
    return out


def load_into(mine: Mapping[str, torch.Tensor], given: Mapping[str, Any], known: set[str],
              strict: bool) -> tuple[list[str], list[str]]:
    """Copy ``given[name]`` into each of this rank's tensors ``mine``; (missing, unexpected):
    names of this rank that ``given`` lacks, and names of ``given`` that are not in the whole
    model (``known``; other ranks' names are expected and skipped). ``strict``: either is an
    error. A shape that differs is always one."""
    missing = [n for n in mine if n not in given]
    unexpected = [n for n in given if n not in known and n not in mine]
    if strict and (missing or unexpected):
        raise ConfigError("load_state_dict: " + "; ".join(
            f"{what} {few(names)}" for what, names in
            (("missing on this rank:", missing), ("not in the model:", unexpected)) if names))
    for name, t in mine.items():
        if name in given:
            value = torch.as_tensor(given[name])
            if value.shape != t.shape:
                raise ConfigError(f"load_state_dict: {name} has shape {tuple(value.shape)}, "
                                  f"the model's is {tuple(t.shape)}")
            assign(t, value)
    return missing, unexpected


