"""One job, checked: before the first step every rank describes the job it was given (the
schedule and a digest of its ops, p, m, dp, steps, seed, learning rate and optimizer, the
model and a digest of its parameter shapes, dtype, partition, checkpoint directory) in a small
dict of strings, the ranks all-gather those dicts (one collective over ``comm``), and a
mismatch is one ``ConfigError`` on every rank naming each field that differs and which ranks
hold which value. Without it, ranks launched with different ``--seed`` or ``--lr`` trained
together silently, and a different ``-m``, ``--hidden`` or factory ended in a shape error or a
"rank dead or stuck?" after the timeout.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flexpipe.errors import ConfigError

Digest = dict[str, str]


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def shape_digest(shapes: Iterable[tuple[str, Sequence[int]]]) -> str:
    """Parameter count and a digest of (name, shape) pairs, e.g. ``1,234 parameters
    (3f2a...)``: equal for the same architecture, whatever the weights."""
    pairs = sorted((name, tuple(int(d) for d in shape)) for name, shape in shapes)
    count = 0
    for _, shape in pairs:
        size = 1
        for d in shape:
            size *= d
        count += size
    return f"{count:,} parameters ({_short(repr(pairs))})"


def _get(obj: Any, name: str) -> str:
    value = getattr(obj, name, None)
    return "-" if value is None else str(value)


def describe_job(job: Any, shapes: str | None = None) -> Digest:
    """The fields of ``job`` (a ``Job``: ``schedule``, ``model``, ``train``, ``partition``)
    that every rank must agree on, as strings keyed by the option that sets them;
    ``shapes``: ``shape_digest`` of the model this rank built (a factory's model)."""
    schedule, model, train = job.schedule, job.model, job.train
    folder = getattr(train, "checkpoint_dir", None)
    out: Digest = {
        "schedule": str(schedule.name or "(unnamed)"),
        "schedule ops": _short(schedule.to_text()),
        "-p": str(schedule.num_ranks), "-m": str(schedule.microbatches),
        "--dp": _get(train, "dp"), "--dp-replicate": _get(train, "dp_replicate"),
        "--tp": _get(train, "tp"),
        "--ep": _get(train, "ep"), "--steps": _get(train, "steps"),
        "--seed": _get(model, "seed"), "layer seed": _get(train, "seed"),
        "--lr": _get(train, "lr"), "--optimizer": _get(train, "optimizer"),
        "momentum": _get(train, "momentum"),
        "--model": _get(model, "name") + (f" {model.factory}" if getattr(model, "factory", "")
                                         else ""),
        "--dtype": _get(model, "dtype"),
        "--partition": _get(job, "partition"),
        "--checkpoint-dir": "-" if folder is None else os.path.abspath(folder),
        "--checkpoint-every": _get(train, "checkpoint_every"),
        "--on-nan": _get(train, "on_nan"),
        "--max-norm": _get(train, "max_norm"), "lr schedule": _get(train, "lr_schedule"),
        "AdamW": f"{_get(train, 'betas')} {_get(train, 'eps')} {_get(train, 'weight_decay')}",
        "--data": _get(train, "data"), "--val-every": _get(train, "val_every"),
    }
    for key in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch", "dropout"):
        out[f"--{key.replace('_', '-')}"] = _get(model, key)
    if shapes is not None:
        out["model shapes"] = shapes
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def differences(every: Sequence[Mapping[str, str]]) -> list[str]:
    """One line per field on which the ranks' descriptions (``every``, in rank order)
    differ: ``--seed: 0 on ranks 0, 2; 1 on rank 1``."""
    lines = []
    fields = dict.fromkeys(k for d in every for k in d)
    for field in fields:
        holders: dict[str, list[int]] = {}
        for rank, digest in enumerate(every):
            holders.setdefault(digest.get(field, "(none)"), []).append(rank)
        if len(holders) > 1:
            lines.append(f"{field}: " + "; ".join(f"{value} on {_ranks(ranks)}"
                                                   for value, ranks in holders.items()))
    return lines


def check_same(every: Sequence[Mapping[str, str]]) -> None:
    """A ``ConfigError`` naming every field on which the ranks' jobs differ (None differ:
    nothing)."""
    lines = differences(every)
    if lines:
        raise ConfigError("the ranks were given different jobs (start every rank with the same "
                          "command and files): " + " | ".join(lines))


def user_shapes(user: Any) -> str | None:
    """``shape_digest`` of a user model's module(s) (a ``UserModel``; None: no user model)."""
    module = getattr(user, "module", None)
    if module is None:
        return None
    modules = module if isinstance(module, Sequence) else [module]
    return shape_digest((f"{i}.{name}", tuple(p.shape)) for i, m in enumerate(modules)
                        for name, p in m.named_parameters())


def agree_job(job: Any, shapes: str | None = None) -> None:
    """Collective: compare this rank's job with every other rank's (``describe_job``) and fail
    on every rank, naming the fields and ranks, when they differ."""
    from flexpipe.runtime.transport import comm

    check_same(comm.all_gather_object(describe_job(job, shapes)))


def agree_weights(model: Any) -> None:
    """Collective: every rank must start from the same weights (``model``: an ``nn.Module`` or
    a list of them, as each rank built it); one sum per parameter is all-gathered, and a
    ``ConfigError`` on every rank names the first rank and parameter that differ from rank
    0's. The public API (``flexpipe.pipeline``) and ``flexpipe run --model PKG.MOD:FACTORY``
    both check with it, after the shapes (``user_shapes``) agree."""
    import torch
    from torch import nn

    from flexpipe.runtime.transport import comm

    root = model if isinstance(model, nn.Module) else nn.ModuleList(model)
    with torch.no_grad():
        named = [(name, float(p.double().sum())) for name, p in root.named_parameters()]
    every = comm.all_gather_object(named)
    for rank, theirs in enumerate(every):
        differ = next((name for (name, a), (_, b) in zip(every[0], theirs, strict=False)
                       if a != b and not (a != a and b != b)), None)
        if differ is not None or len(theirs) != len(every[0]):
            raise ConfigError(f"rank {rank} built other initial weights than rank 0 (parameter "
                              f"{differ or '(count)'} differs): build the same weights on every "
                              f"rank (seed torch with torch.manual_seed before building the "
                              f"model; no value may depend on the rank)")
