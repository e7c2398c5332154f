"""Checkpoints through torch.distributed.checkpoint (DCP) keyed by name, the one format of
``Pipeline.save``/``load`` and of ``flexpipe run --checkpoint-dir``: every tensor under a name
that does not depend on how the model is cut or spread (your model's names for a ``Pipeline``;
the whole model's layer names, ``3.qkv.weight``, for the command line), so that a checkpoint
written at one (pp, dp, tp) loads at another: DCP reads each rank's part by name, FSDP2 and
tensor-parallel shards (DTensors) included.

Keys: ``model.NAME`` (a parameter or a persistent buffer), ``optim.state.NAME.KEY`` (the
optimizer's state of parameter NAME: ``exp_avg``, ``step``, ``momentum_buffer``, ...) and
``optim.group.NAME.KEY`` (the hyperparameters of NAME's parameter group: ``lr``, ``betas``,
...). Every rank writes its own file; a key several ranks hold (a tied weight, a data-parallel
replica's copy) is written once. The folder is written whole or not at all and checked before
it is read (``saved``); loading, every rank first checks that the checkpoint has what it needs
and the ranks agree (``comm.complaints``), so a bad checkpoint raises the same error on every
rank; nothing in the folder runs code when read (``transport.safedcp``). Every step of a
save or load that a rank takes on its own (its entries, its files' digests, the optimizer's
state) is followed by such an agreement, so that an exception there on one rank (yours: an
optimizer that raises; or the system's: a file that cannot be read) is one error on every rank,
naming the rank and the exception, and no rank waits for another that has stopped. The ranks
must give the same path (each is named when they do not).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.processes import saved
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import placeholder

MODEL, STATE, GROUP = "model.", "optim.state.", "optim.group."
Entries = dict[str, Any]
"""A checkpoint's flat content: key -> tensor (or plain value)."""


def few(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def reason(exc: Exception) -> str:
    """What a rank says when its part of a save or load raised: a ConfigError's text, another
    exception named by its type."""
    if isinstance(exc, ConfigError):
        return str(exc)
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}".rstrip(": ")


def same_path(path: str) -> str | None:
    """Why the ranks may not save to or load ``path`` together: they gave different paths
    (None: every rank gave this one). Every rank calls it at the same point."""
    every = comm.all_gather_object(os.path.abspath(path)) if comm.world_size() > 1 else [path]
    if len(set(every)) == 1:
        return None
    return "the ranks gave different paths (" + ", ".join(
        f"rank {r}: {p}" for r, p in enumerate(every)) + "); every rank must give the same one"


def agree(mine: str | None, what: str) -> None:
    """Every rank's verdict on a collective call compared: one bad rank raises on all."""
    bad = comm.complaints(mine)
    if bad:
        raise ConfigError(f"{what} refused on every rank: " +
                          "; ".join(f"rank {r}: {text}" for r, text in sorted(bad.items())))


def _name_of(p: torch.Tensor, names: Mapping[int, str]) -> str:
    if id(p) not in names:
        raise ConfigError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not "
                          "one of this rank's parameters (build it on pipe.parameters())")
    return names[id(p)]


def optimizer_entries(opt: torch.optim.Optimizer, names: Mapping[int, str]) -> dict[str, Any]:
    """The optimizer's state and hyperparameters keyed by parameter name."""
    out: dict[str, Any] = {}
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            name = _name_of(p, names)
            out.update({f"{GROUP}{name}.{k}": v for k, v in hyper.items()})
            out.update({f"{STATE}{name}.{k}": v for k, v in opt.state.get(p, {}).items()})
    return out


def save(mine: Mapping[str, torch.Tensor], path: str, optimizer: torch.optim.Optimizer | None,
         names: Mapping[int, str], *, what: str = "Pipeline.save",
         extra: Mapping[str, Any] | None = None) -> None:
    """Write this rank's tensors ``mine`` (and ``optimizer``'s state) to the DCP checkpoint
    ``path``: into a new sibling folder, hashed, then renamed into place once every rank has
    written (``saved``); every rank calls it together. ``extra``: more JSON fields for the
    manifest (rank 0's)."""
    entries: Entries = {MODEL + n: t for n, t in mine.items()}
    verdict, rank = same_path(path), comm.my_rank()
    try:
        if optimizer is not None and verdict is None:
            entries.update(optimizer_entries(optimizer, names))
        if rank == 0 and verdict is None:
            verdict = saved.prepare(path)
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        verdict = reason(exc)
    agree(verdict, f"{what} to {path}")
    folder = saved.staging(path)
    comm.checkpoint_save(entries, str(folder))
    try:
        files: saved.Files | str = saved.own_files(folder, rank)
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        files = reason(exc)
    every = comm.all_gather_object(files)  # one list on every rank
    _failed(f"{what} to {path}", {r: t for r, t in enumerate(every) if isinstance(t, str)})
    verdict = None
    if rank == 0:
        try:
            written = {n: e for got in every if isinstance(got, dict) for n, e in got.items()}
            saved.publish(folder, path, written, _kind(optimizer), extra or {})
        except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
            verdict = f"could not make {folder} the checkpoint {path}: {reason(exc)}"
    _failed(f"{what} to {path}", comm.complaints(verdict))


def _kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    return None if optimizer is None else type(optimizer).__name__


def _failed(what: str, bad: Mapping[int, str]) -> None:
    """A RunError naming each rank's failure while saving (none: nothing to raise)."""
    if bad:
        raise RunError(f"{what} failed (the previous checkpoint there, if any, is kept): " +
                       "; ".join(f"rank {r}: {text}" for r, text in sorted(bad.items())))


def load(mine: Mapping[str, torch.Tensor], path: str, optimizer: torch.optim.Optimizer | None,
         names: Mapping[int, str], *, what: str = "Pipeline.load",
         verify: bool = True) -> dict[str, Any]:
    """Read this rank's tensors ``mine`` (and ``optimizer``'s state) from the DCP checkpoint
    ``path``, whatever the number of ranks that wrote it, once its files are checked against
    its manifest (``saved``; ``verify`` False: the caller checked them); its manifest. Every
    rank calls it together."""
    wanted: Entries = {}
    verdict = same_path(path)
    body: dict[str, Any] = {}
    try:
        if verdict is None:
            body, wanted = _checked(mine, path, optimizer, names, verify)
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        verdict = reason(exc)
    agree(verdict, f"{what} of {path}")
    comm.checkpoint_load(wanted, path)
    verdict = None
    try:
        if optimizer is not None:
            optimizer.load_state_dict(optimizer_state(optimizer, names, wanted))
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        verdict = f"the optimizer's state could not be loaded: {reason(exc)}"
    bad = comm.complaints(verdict)
    if bad:
        raise RunError(f"{what} of {path} failed (every rank's parameters and buffers are "
                       "loaded, the optimizer's state not on the ranks named): " +
                       "; ".join(f"rank {r}: {text}" for r, text in sorted(bad.items())))
    return body


def _checked(mine: Mapping[str, torch.Tensor], path: str,
             optimizer: torch.optim.Optimizer | None, names: Mapping[int, str],
             verify: bool) -> tuple[dict[str, Any], Entries]:
    """The manifest of ``path`` and what this rank loads from it, after its share of the file
    checks (``verify``) and the checks of its keys, shapes and optimizer (a ``ConfigError``
    naming what is wrong)."""
    body = saved.manifest(path)
    if isinstance(body, str):
        raise ConfigError(body)
    damage = saved.damage(path, body, comm.my_rank(), comm.world_size()) if verify else None
    if damage is not None:
        raise ConfigError(damage)
    keys = comm.checkpoint_keys(path)
    wanted = _model_wanted(mine, keys)
    if optimizer is not None:
        kind = body.get("optimizer")
        if kind is not None and kind != _kind(optimizer):
            raise ConfigError(f"the checkpoint holds the state of a {kind} optimizer, the one "
                              f"given is a {_kind(optimizer)}: load it into a {kind}, or load "
                              f"without optimizer= and start the {_kind(optimizer)} afresh")
        wanted.update(_optimizer_wanted(optimizer, names, keys))
    return body, wanted


def _model_wanted(mine: Mapping[str, torch.Tensor],
                  keys: Mapping[str, comm.TensorInfo | None]) -> dict[str, Any]:
    """This rank's tensors to load in place, checked against the checkpoint's keys."""
    missing = [n for n in mine if MODEL + n not in keys]
    if missing:
        raise ConfigError(f"the checkpoint lacks {few(missing)} (is it of another model?)")
    for n, t in mine.items():
        info = keys[MODEL + n]
        if info is None or info[0] != tuple(t.shape):
            raise ConfigError(f"{n}: the checkpoint's is {info and info[0]}, the model's has "
                              f"shape {tuple(t.shape)}")
    return {MODEL + n: t for n, t in mine.items()}


def _optimizer_wanted(opt: torch.optim.Optimizer, names: Mapping[int, str],
                      keys: Mapping[str, comm.TensorInfo | None]) -> dict[str, Any]:
    """Placeholders for the optimizer entries of this rank's parameters in the checkpoint."""
    mine = {_name_of(p, names): p for g in opt.param_groups for p in g["params"]}
    out: dict[str, Any] = {}
    for key, info in keys.items():
        if key.startswith((STATE, GROUP)) and _split(key)[1] in mine:
            param = mine[_split(key)[1]]
            out[key] = None if info is None else placeholder(param, info[0], info[1])
    if not any(k.startswith(GROUP) for k in out):
        raise ConfigError("the checkpoint holds no optimizer state for this rank's parameters "
                          "(saved without optimizer=?)")
    return out


def _split(key: str) -> tuple[str, str, str]:
    """``optim.state.NAME.KEY`` -> (``optim.state.``, NAME, KEY)."""
    head = STATE if key.startswith(STATE) else GROUP
    name, _, last = key[len(head):].rpartition(".")
    return head, name, last


def optimizer_state(opt: torch.optim.Optimizer, names: Mapping[int, str],
                     loaded: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` (integer ids in group order) from the loaded entries."""
    per: dict[tuple[str, str], dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith((STATE, GROUP)):
            head, name, last = _split(key)
            per.setdefault((head, name), {})[last] = value
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in opt.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        got = [_name_of(p, names) for p in group["params"]]
        hyper.update(next((per[(GROUP, n)] for n in got if (GROUP, n) in per), {}))
        for n in got:
            if (STATE, n) in per:
                state[index] = per[(STATE, n)]
            index += 1
        groups.append({**hyper, "params": list(range(index - len(got), index))})
    return {"state": state, "param_groups": groups}
