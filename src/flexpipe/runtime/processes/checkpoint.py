"""Checkpoints of ``flexpipe run``: torch.distributed.checkpoint (DCP) folders written by the
one writer of ``Pipeline.save`` (``dcp``), the parameters under the whole model's names
(``3.qkv.weight``, whatever stage holds layer 3), so that a run resumes at another (pp, dp,
tp), another schedule or another cut, with FSDP2 and tensor-parallel shards.

Layout under the checkpoint directory::

    step-00000004/__0_0.distcp ...       every rank's DCP file (a key several ranks hold once)
    step-00000004/.metadata              DCP's index
    step-00000004/flexpipe-manifest.json written last: files, sizes, SHA-256; the step, the data
                                         position (global samples), the model, the layout that
                                         wrote it, every rank's RNG state

A checkpoint is written to ``.step-00000004.saving`` and renamed into place once every rank has
written and hashed its files (``saved``), so one cut short by a crash is never picked up; the
``KEEP`` newest complete ones are kept. Before it is written the ranks check together that it
fits in the space left and that every tensor is finite (else nothing is written, the complete
ones are kept). Before one is used, every rank checks its share of the files against the
manifest (size, SHA-256); one that fails is skipped on every rank, naming the file and the
reason, and the next older one is tried. Nothing in it runs code when read
(``transport.safedcp``); after loading, a NaN or an infinity in a parameter or optimizer state
is refused naming the tensor.

Resumed at the layout that wrote it, every rank restores its own RNG state; at another layout
the ranks' generators do not map onto the new ones and are left as they are (a run with
``--seed`` draws its random numbers from the step, micro-batch and layer: the same at any
layout). A checkpoint of the older per-stage format is read once, with a notice (``legacy``).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import ckdir, dcp, legacy
from flexpipe.runtime.processes.ckdir import step_dir
from flexpipe.runtime.processes.manifests import (
    DCP,
    Manifest,
    complete,
    damage,
    find,
    newer,
    step_of,
)
from flexpipe.runtime.processes.manifests import inspect as inspect  # this module's API too
from flexpipe.runtime.processes.manifests import latest as latest
from flexpipe.runtime.processes.numerics import NonFiniteError, first_nonfinite
from flexpipe.runtime.processes.rngstate import as_json, from_json, rng_state, set_rng_state
from flexpipe.runtime.transport import comm
from flexpipe.runtime.transport.engines import local

KEEP = 2
"""Complete checkpoints kept (older ones are deleted once a newer one is complete)."""

Stages = Mapping[int, StageModule]


def named(stages: Stages) -> dict[str, torch.Tensor]:
    """This rank's parameters by global name (a tensor held under two names once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for s in sorted(stages):
        for name, p in stages[s].named_global_parameters().items():
            if id(p) not in seen:
                seen.add(id(p))
                out[name] = p
    return out


def _names(mine: Mapping[str, torch.Tensor]) -> dict[int, str]:
    return {id(p): name for name, p in mine.items()}


def describe(model: ModelSpec, optimizer: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the model and the optimizer (not the
    layout: a checkpoint resumes at any). The model's automatic cut is a list, as JSON reads
    it back, and only where there is one."""
    spec = asdict(model)
    cut = spec.pop("cut")
    return {"model": spec | ({"cut": list(cut)} if cut else {}), "optimizer": optimizer}


def check_meta(manifest: Manifest, meta: Mapping[str, Any]) -> None:
    """A ``ConfigError`` naming what differs between the checkpoint and this run."""
    for key, want in meta.items():
        got = manifest.meta.get(key)
        if got != want:
            raise ConfigError(f"checkpoint {manifest.path} was written for {key} {got}, this "
                              f"run has {want}; use another --checkpoint-dir or the same "
                              f"{key}")


def _entries(mine: Mapping[str, torch.Tensor], opt: torch.optim.Optimizer) -> dict[
        str, torch.Tensor]:
    """This rank's parameters and optimizer state tensors, by what they are."""
    out = {f"parameter {n}": p.detach() for n, p in mine.items()}
    for n, p in mine.items():
        out.update((f"optimizer state {k} of {n}", t) for k, t in opt.state.get(p, {}).items()
                   if isinstance(t, torch.Tensor))
    return out


def payload_bytes(stages: Stages, opt: torch.optim.Optimizer, replica: int = 0) -> int:
    """About the bytes this rank writes in a checkpoint: its parts of the DTensors (FSDP2,
    tensor parallel) and, on replica 0, its whole tensors (the other replicas' copies are
    written once), plus room for DCP's index."""
    tensors = _entries(named(stages), opt).values()
    return sum(local(t).numel() * t.element_size() for t in tensors
               if replica == 0 or local(t) is not t) + 64 * 1024


def save(root: str | Path, step: int, stages: Stages, opt: torch.optim.Optimizer, *,
         samples: int = 0, meta: Mapping[str, Any] | None = None,
         layout: Mapping[str, int] | None = None) -> Path:
    """Write the checkpoint taken before ``step`` (``samples`` global samples read) and delete
    all but the ``KEEP`` newest complete ones; every rank calls it together. A NaN or an
    infinity in any rank's tensors writes nothing (``NonFiniteError`` on every rank)."""
    folder, mine = step_dir(root, step), named(stages)
    bad = first_nonfinite(_entries(mine, opt))
    every = comm.complaints(None if bad is None else bad)
    if every:
        rank, name = min(every.items())
        raise NonFiniteError(f"checkpoint {folder} not written (step {step}; the checkpoints "
                             f"already complete are kept): on rank {rank}, {name} holds nan "
                             f"or inf", rank if rank != comm.my_rank() else None)
    rng = comm.all_gather_object(as_json(rng_state()))
    if comm.my_rank() == 0:
        ckdir.clear_leftover(folder)
    extra = {"step": step, "samples": samples, "meta": dict(meta or {}),
             "layout": dict(layout or {}), "rng": rng}
    dcp.save(mine, str(folder), opt, _names(mine), what="checkpoint", extra=extra)
    if comm.my_rank() == 0:
        _prune(Path(root), step)
    return folder


def _prune(root: Path, newest: int) -> None:
    steps = [m.step for m in complete(root)]
    keep = set(sorted(steps, reverse=True)[:KEEP])
    for folder in root.glob("step-*"):
        step = step_of(folder)
        if step is not None and step < newest and step not in keep and not newer(folder):
            shutil.rmtree(folder, ignore_errors=True)


def shared_damage(manifest: Manifest) -> str | None:
    """Every rank checks its share of ``manifest``'s files; the first damage any found (the
    same verdict on every rank)."""
    found = comm.complaints(damage(manifest, comm.my_rank(), max(comm.world_size(), 1)))
    return found[min(found)] if found else None


def load(manifest: Manifest, stages: Stages, opt: torch.optim.Optimizer,
         layout: Mapping[str, int], batch: int = 0) -> int:
    """Load this rank's parameters and optimizer state from ``manifest`` (files already
    checked); restore its RNG state where ``layout`` is the checkpoint's; the data position
    (global samples) it records (a per-stage checkpoint: its step x ``batch``, the global
    samples a step reads). Every rank calls it together."""
    mine = named(stages)
    if manifest.kind == DCP:
        body = dcp.load(mine, str(manifest.path), opt, _names(mine), what="checkpoint",
                        verify=False)
        rng = body.get("rng")
        same = body.get("layout") == dict(layout) and isinstance(rng, list) and \
            len(rng) == max(comm.world_size(), 1)
        state = from_json(rng[comm.my_rank()]) if same else None  # type: ignore[index]
        samples = int(body["samples"])
    else:
        state = legacy.load(manifest, mine, opt, _names(mine), sorted(stages),
                            layout.get("stages", 0))
        samples = manifest.step * batch
    _refuse_nonfinite(manifest, mine, opt)
    if state is not None:
        _restore(manifest, state)
    return samples


def _refuse_nonfinite(manifest: Manifest, mine: Mapping[str, torch.Tensor],
                      opt: torch.optim.Optimizer) -> None:
    bad = first_nonfinite(_entries(mine, opt))
    dcp.agree(None if bad is None else f"{bad} holds non-finite values (written by an older "
              f"FlexPipe, or by hand?); move that checkpoint away to resume from the one "
              f"before", f"checkpoint {manifest.path}")


def _restore(manifest: Manifest, state: Mapping[str, Any]) -> None:
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"checkpoint {manifest.path} refused: its RNG state cannot be "
                          f"restored ({type(exc).__name__})") from None


@dataclass(frozen=True)
class Checkpointer:
    """Checkpointing of one rank of a run: resume from the newest complete checkpoint, and
    write one every ``every`` steps (0: only after the last step) and after the last step.
    ``layout``: the run's ``pp``, ``dp``, ``tp`` and ``stages``; ``batch``: the global samples
    a step reads."""

    root: Path
    every: int
    steps: int
    rank: int
    meta: dict[str, Any]
    timeout_s: float
    layout: dict[str, int]
    batch: int = 0
    replica: int = 0

    def resume(self, stages: Stages, opt: torch.optim.Optimizer) -> tuple[int, int]:
        """Load the newest intact checkpoint, if any; the step to start at and the global
        samples read before it. Rank 0 says on stderr which checkpoint it used (or that it
        starts from scratch) and which newer ones it skipped and why; a checkpoint of another
        model, or past this run's steps, is refused (``ConfigError``)."""
        manifest, skipped = find(self.root, shared_damage)
        start = 0 if manifest is None else manifest.step
        ckdir.in_the_way(self.root, ckdir.plan_for(0, start, self.steps, self.every))
        for line in skipped:
            self._say(line)
        if manifest is None:
            self._say(f"no usable checkpoint in {self.root}: starting from scratch")
            return 0, 0
        check_meta(manifest, self.meta)
        if manifest.step > self.steps:
            raise ConfigError(f"checkpoint {manifest.path} is at step {manifest.step}, past "
                              f"this run's {self.steps} steps; give --steps >= {manifest.step} "
                              f"or another --checkpoint-dir")
        samples = load(manifest, stages, opt, self.layout, self.batch)
        self._announce(manifest)
        return manifest.step, samples

    def _announce(self, manifest: Manifest) -> None:
        done = " (every step already done)" if manifest.step == self.steps else ""
        self._say(f"resuming from {manifest.path} (step {manifest.step} of {self.steps})"
                  f"{done}")
        if manifest.kind != DCP:
            self._say(f"{manifest.path} is in the per-stage format of an older FlexPipe: "
                      f"resumed from it this once; this run writes its checkpoints in DCP "
                      f"(the format of Pipeline.save)")
            return
        was = manifest.body.get("layout") or {}
        shown = ("pp", "dp", "tp")
        if any(was.get(k) != self.layout.get(k) for k in shown):
            old = ", ".join(f"{k} {was.get(k, '?')}" for k in shown)
            new = ", ".join(f"{k} {self.layout.get(k)}" for k in shown)
            self._say(f"written at {old}, resharded onto {new}: parameters, optimizer state "
                      f"and data position carried over; the ranks' RNG states are not (use "
                      f"--seed for random numbers that do not depend on the layout)")

    def _check_room(self, done: int, stages: Stages, opt: torch.optim.Optimizer) -> None:
        """Collective: a ``RunError`` on every rank, before any file is written, when the
        files the ranks are about to write do not fit in the space free on the fullest rank's
        file system."""
        mine = payload_bytes(stages, opt, self.replica)
        every = comm.all_gather_object((mine, ckdir.free_space(self.root)))
        problem = ckdir.room(self.root, sum(n for n, _ in every), min(f for _, f in every),
                             done)
        if problem is not None:
            raise RunError(problem)

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {line}", file=sys.stderr, flush=True)

    def after(self, step: int, stages: Stages, opt: torch.optim.Optimizer,
              samples: int) -> None:
        """After ``step`` ran (``samples`` global samples read so far): write a checkpoint
        when one is due (every rank calls this)."""
        done = step + 1
        if not ckdir.is_due(done, self.steps, self.every):
            return
        self._check_room(done, stages, opt)
        save(self.root, done, stages, opt, samples=samples, meta=self.meta, layout=self.layout)
