"""A ``Pipeline``'s state under your model's own names: this rank's parameters and buffers
(``state_dict``/``load_state_dict``, ``named_buffers``) and checkpoints through
torch.distributed.checkpoint (DCP), keyed by those names, so that a checkpoint written at
p = 2 loads at p = 4 (other stages per rank) exactly.

A checkpoint's keys: ``model.NAME`` (a parameter or a persistent buffer, as your model's
``state_dict`` names it), ``optim.state.NAME.KEY`` (the optimizer's state of parameter NAME:
``exp_avg``, ``step``, ``momentum_buffer``, ...) and ``optim.group.NAME.KEY`` (the
hyperparameters of NAME's parameter group: ``lr``, ``betas``, ...). Every rank writes its own
file; a key several ranks hold (a tied weight, a data-parallel replica's copy) is written once.
Loading, every rank first checks that the checkpoint has what it needs and the ranks agree
(``comm.complaints``), so a bad checkpoint raises the same error on every rank. Every step of a
save or load that a rank takes on its own (its entries, its files' digests, the optimizer's
state) is followed by such an agreement, so that an exception there on one rank (yours: an
optimizer that raises; or the system's: a file that cannot be read) is one error on every rank,
naming the rank and the exception, and no rank waits for another that has stopped. The ranks
must give the same path (each is named when they do not).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.pipeline import saved
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import assign, placeholder

MODEL, STATE, GROUP = "model.", "optim.state.", "optim.group."
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
            f"{what} {_few(names)}" for what, names in
            (("missing on this rank:", missing), ("not in the model:", unexpected)) if names))
    for name, t in mine.items():
        if name in given:
            value = torch.as_tensor(given[name])
            if value.shape != t.shape:
                raise ConfigError(f"load_state_dict: {name} has shape {tuple(value.shape)}, "
                                  f"the model's is {tuple(t.shape)}")
            assign(t, value)
    return missing, unexpected


def _few(names: list[str], shown: int = 5) -> str:
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
         names: Mapping[int, str]) -> None:
    """Write this rank's tensors ``mine`` (and ``optimizer``'s state) to the DCP checkpoint
    ``path``: into a new sibling folder, hashed, then renamed into place once every rank has
    written (``saved``); every rank calls it together."""
    entries: dict[str, Any] = {MODEL + n: t for n, t in mine.items()}
    verdict, rank = same_path(path), comm.my_rank()
    try:
        if optimizer is not None and verdict is None:
            entries.update(optimizer_entries(optimizer, names))
        if rank == 0 and verdict is None:
            verdict = saved.prepare(path)
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        verdict = reason(exc)
    agree(verdict, f"Pipeline.save to {path}")
    folder = saved.staging(path)
    comm.checkpoint_save(entries, str(folder))
    try:
        files: saved.Files | str = saved.own_files(folder, rank)
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        files = reason(exc)
    every = comm.all_gather_object(files)  # one list on every rank
    _failed(f"Pipeline.save to {path}", {r: t for r, t in enumerate(every) if isinstance(t, str)})
    verdict = None
    if rank == 0:
        try:
            written = {n: e for got in every if isinstance(got, dict) for n, e in got.items()}
            saved.publish(folder, path, written, _kind(optimizer))
        except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
            verdict = f"could not make {folder} the checkpoint {path}: {reason(exc)}"
    _failed(f"Pipeline.save to {path}", comm.complaints(verdict))


def _kind(optimizer: torch.optim.Optimizer | None) -> str | None:
    return None if optimizer is None else type(optimizer).__name__


def _failed(what: str, bad: Mapping[int, str]) -> None:
    """A RunError naming each rank's failure while saving (none: nothing to raise)."""
    if bad:
        raise RunError(f"{what} failed (the previous checkpoint there, if any, is kept): " +
                       "; ".join(f"rank {r}: {text}" for r, text in sorted(bad.items())))


def load(mine: Mapping[str, torch.Tensor], path: str, optimizer: torch.optim.Optimizer | None,
         names: Mapping[int, str]) -> None:
    """Read this rank's tensors ``mine`` (and ``optimizer``'s state) from the DCP checkpoint
    ``path``, whatever the number of ranks that wrote it, once its files are checked against
    its manifest (``saved``); every rank calls it together."""
    verdict, wanted = same_path(path), {}
    try:
        wanted = {} if verdict is not None else _checked(mine, path, optimizer, names)
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        verdict = reason(exc)
    agree(verdict, f"Pipeline.load of {path}")
    comm.checkpoint_load(wanted, path)
    verdict = None
    try:
        if optimizer is not None:
            optimizer.load_state_dict(_optimizer_state(optimizer, names, wanted))
    except Exception as exc:  # noqa: BLE001 - one error on every rank, naming it
        verdict = f"the optimizer's state could not be loaded: {reason(exc)}"
    bad = comm.complaints(verdict)
    if bad:
        raise RunError(f"Pipeline.load of {path} failed (every rank's parameters and "
                       "buffers are loaded, the optimizer's state not on the ranks named): " +
                       "; ".join(f"rank {r}: {text}" for r, text in sorted(bad.items())))


def _checked(mine: Mapping[str, torch.Tensor], path: str,
             optimizer: torch.optim.Optimizer | None, names: Mapping[int, str]) -> dict[str, Any]:
    """What this rank loads from ``path``, after its share of the file checks and the checks
    of its keys, shapes and optimizer (a ``ConfigError`` naming what is wrong)."""
    body = saved.manifest(path)
    if isinstance(body, str):
        raise ConfigError(body)
    damage = saved.damage(path, body, comm.my_rank(), comm.world_size())
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
    return wanted


def _model_wanted(mine: Mapping[str, torch.Tensor],
                  keys: Mapping[str, comm.TensorInfo | None]) -> dict[str, Any]:
    """This rank's tensors to load in place, checked against the checkpoint's keys."""
    missing = [n for n in mine if MODEL + n not in keys]
    if missing:
        raise ConfigError(f"the checkpoint lacks {_few(missing)} (is it of another model?)")
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


def _optimizer_state(opt: torch.optim.Optimizer, names: Mapping[int, str],
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
