"""Resuming once from a checkpoint of the per-stage format earlier FlexPipe versions wrote (one
``torch.save`` file per stage, ``stage-N.pt``: its parameters and optimizer state by global
parameter name, the RNG state of the rank that held it, the step): the run reads it, says so,
and writes DCP from then on (``checkpoint``).

Each stage file is read with ``torch.load(weights_only=True)`` (loading never executes code: a
payload that would is refused), must hold the stage and step the manifest says, and is refused,
naming the tensor, when a parameter or an optimizer state holds a NaN or an infinity. Every
rank reads every stage file and takes its own parameters from them by name, so the run may
cut the model otherwise, and spread it over FSDP2 or tensor parallelism (a whole tensor goes
into each rank's part of a DTensor)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.processes.dcp import STATE, few, optimizer_state
from flexpipe.runtime.processes.manifests import FORMAT, Manifest
from flexpipe.runtime.processes.numerics import first_nonfinite
from flexpipe.runtime.transport.engines import assign, placeholder

KEYS = ("format", "stage", "step", "rng", "params", "optim")
"""The entries of a stage file."""


def read_stage(path: Path, stage: int, step: int) -> dict[str, Any]:
    """The content of stage file ``path`` (plain data only: ``weights_only``), which must be
    stage ``stage``'s at ``step``, tables of tensors, all finite; a ``ConfigError`` naming
    the file and the reason if not."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read is this file's fault
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise ConfigError(f"checkpoint file {path} refused: not a plain-data stage file "
                          f"({type(exc).__name__}: {first})") from None
    if not isinstance(data, dict) or any(k not in data for k in KEYS):
        raise ConfigError(f"checkpoint file {path} refused: it lacks the entries {KEYS}")
    if (data["format"], data["stage"], data["step"]) != (FORMAT, stage, step):
        raise ConfigError(f"checkpoint file {path} refused: it holds stage {data['stage']!r} "
                          f"at step {data['step']!r} (format {data['format']!r}), the manifest "
                          f"says stage {stage} at step {step}")
    params, optim = data["params"], data["optim"]
    if not isinstance(params, dict) or not isinstance(optim, dict) or not all(
            isinstance(t, torch.Tensor) for t in params.values()) or not all(
            isinstance(st, dict) and n in params for n, st in optim.items()):
        raise ConfigError(f"checkpoint file {path} refused: its params or optim entry is not "
                          f"a table of tensors by parameter")
    bad = first_nonfinite(tensors(data))
    if bad is not None:
        raise ConfigError(f"checkpoint file {path} refused: {bad} holds non-finite values "
                          f"(written by an older FlexPipe, or by hand?); move that checkpoint "
                          f"away to resume from the one before")
    return data


def tensors(payload: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A stage file's parameters and optimizer state tensors, by what they are."""
    return {f"parameter {n}": t for n, t in payload["params"].items()} | {
        f"optimizer state {k} of {n}": t for n, state in payload["optim"].items()
        for k, t in state.items() if isinstance(t, torch.Tensor)}


def load(manifest: Manifest, mine: Mapping[str, torch.Tensor], opt: torch.optim.Optimizer,
         names: Mapping[int, str], stages: list[int], num_stages: int) -> dict[str, Any] | None:
    """Load this rank's parameters ``mine`` (by global name) and their optimizer state from
    every stage file of ``manifest`` (every rank of a DTensor's mesh calls this together);
    the RNG state saved with the lowest of this rank's ``stages`` where the checkpoint was cut
    into as many stages, ``num_stages`` (None: another cut, whose ranks' generators do not
    map onto these)."""
    files = {s: read_stage(manifest.path / name, s, manifest.step)
             for s, name in sorted(manifest.files.items())}
    params = {n: t for data in files.values() for n, t in data["params"].items()}
    optim = {n: st for data in files.values() for n, st in data["optim"].items()}
    wrong = sorted(n for n, p in mine.items() if n not in params or params[n].shape != p.shape)
    if wrong:
        raise ConfigError(f"checkpoint {manifest.path} does not fit this run: parameters "
                          f"{few(wrong, 4)} are missing or of another shape (another model?)")
    for name, p in mine.items():
        assign(p, params[name])
    loaded: dict[str, Any] = {}
    for name, state in optim.items():
        if name in mine:
            loaded.update((f"{STATE}{name}.{key}", _like(mine[name], value))
                          for key, value in state.items())
    opt.load_state_dict(optimizer_state(opt, names, loaded))
    same_cut = manifest.meta.get("stages") == num_stages and stages
    return files[min(stages)]["rng"] if same_cut else None


def _like(param: torch.Tensor, value: Any) -> Any:
    """``value`` (a whole tensor of the optimizer state) spread as ``param`` is, where it has
    its shape; other values as they are."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
        return value
    out = placeholder(param, tuple(value.shape), value.dtype)
    assign(out, value)
    return out
