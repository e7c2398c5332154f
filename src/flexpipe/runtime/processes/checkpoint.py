"""Checkpoints of a pipeline training run, keyed by *stage* so that a run can resume onto any
schedule with the same stages and partition (another schedule family, another placement).

Layout under the checkpoint directory::

    step-00000004/stage-0.pt      parameters + optimizer state of stage 0 (by global name),
    step-00000004/stage-1.pt      the RNG state of the rank that held it, the step
    step-00000004/manifest.json   written last: the checkpoint is complete once it exists

Every file is written to a temporary name and renamed into place (``os.replace``), and the
manifest (file names, sizes and SHA-256 digests, the model, the step) only after every rank has
written its stages, so a checkpoint cut short by a crash is never picked up. Before a checkpoint
is used, every check of ``flexpipe.runtime.processes.manifests`` is made (its step, files, sizes
and SHA-256); a checkpoint that fails one is skipped with the file and the reason, and the next
older one is tried. Each stage file is then read with ``torch.load(weights_only=True)`` (loading
never executes code: a payload that would is refused), must hold the stage and step the
manifest says, and is refused, naming the tensor, when a parameter or an optimizer state holds
a NaN or an infinity (a file this FlexPipe would not have written). Just before a checkpoint is
written, the ranks check together that it fits in the space left (``Checkpointer``). The data
position is the step itself (a step's micro-batches are a pure function of the step), saved as
the manifest's ``step`` (the next step to run). With data-parallel replicas only replica 0
writes (replicas are identical).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import ckdir
from flexpipe.runtime.processes.ckdir import MANIFEST, stage_file, step_dir, write_error
from flexpipe.runtime.processes.manifests import (
    FORMAT,
    Manifest,
    complete,
    find,
    newer,
    sha256,
    step_of,
)
from flexpipe.runtime.processes.manifests import inspect as inspect  # this module's API too
from flexpipe.runtime.processes.manifests import latest as latest
from flexpipe.runtime.processes.numerics import check_finite, first_nonfinite
from flexpipe.runtime.processes.rngstate import rng_state, set_rng_state

KEEP = 2
"""Complete checkpoints kept (older ones are deleted once a newer one is complete)."""

Stages = Mapping[int, StageModule]


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file in the same directory, synced, then renamed;
    a failed write (no space left, ...) removes the temporary file and is a ``RunError``
    naming ``path`` and the reason."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:
        tmp.unlink(missing_ok=True)
        raise write_error(path, exc) from None
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a crash
    finally:
        os.close(folder)


def _save(payload: dict[str, Any], path: Path) -> None:
    with path.open("wb") as f:  # a file object: a full disk is an OSError (ENOSPC)
        torch.save(payload, f)


def _optim_state(stage: StageModule, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer state of ``stage``'s parameters, by global parameter name."""
    out = {}
    for name, p in stage.named_global_parameters().items():
        state = opt.state.get(p)
        if state:
            out[name] = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                         for k, v in state.items()}
    return out


def save_stages(root: str | Path, step: int, stages: Stages, opt: torch.optim.Optimizer) -> None:
    """Write this rank's stage files of the checkpoint taken before ``step`` (atomically)."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    rng = rng_state()
    for s, stage in stages.items():
        payload = {"format": FORMAT, "stage": s, "step": step, "rng": rng,
                   "params": {n: p.detach().clone()
                              for n, p in stage.named_global_parameters().items()},
                   "optim": _optim_state(stage, opt)}
        check_finite(_tensors(payload), f"checkpoint {folder / stage_file(s)} not written "
                     f"(step {step}; the checkpoints already complete are kept)")
        _atomic(folder / stage_file(s), partial(_save, payload))


def _tensors(payload: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A stage payload's parameters and optimizer state tensors, by what they are."""
    return {f"parameter {n}": t for n, t in payload["params"].items()} | {
        f"optimizer state {k} of {n}": t for n, state in payload["optim"].items()
        for k, t in state.items() if isinstance(t, torch.Tensor)}


def payload_bytes(stages: Stages, opt: torch.optim.Optimizer) -> int:
    """About the bytes the stage files of ``stages`` take on disk: their parameters and
    optimizer state, plus room for torch's archive around them."""
    params = [p for s in stages.values() for p in s.parameters()]
    tensors: list[torch.Tensor] = [*params, *(t for p in params for t in opt.state.get(p, {})
                                              .values() if isinstance(t, torch.Tensor))]
    return sum(t.numel() * t.element_size() + 1024 for t in tensors) + 64 * 1024 * len(stages)


def write_manifest(root: str | Path, step: int, num_stages: int, meta: Mapping[str, Any]) -> Path:
    """Complete the checkpoint of ``step`` (every stage file must be written), then delete all
    but the newest ``KEEP`` complete checkpoints and any unfinished older one."""
    folder = step_dir(root, step)
    files = {str(s): stage_file(s) for s in range(num_stages)}
    missing = [name for name in files.values() if not (folder / name).is_file()]
    if missing:
        raise RunError(f"checkpoint {folder}: stage files {missing} were not written (is "
                          f"the checkpoint directory shared by every rank?)")
    body = {"format": FORMAT, "step": step, "files": files, "meta": dict(meta),
            "sizes": {name: (folder / name).stat().st_size for name in files.values()},
            "sha256": {name: sha256(folder / name) for name in files.values()}}
    _atomic(folder / MANIFEST, lambda tmp: tmp.write_text(json.dumps(body, indent=1)))
    _prune(Path(root), step)
    return folder


def _prune(root: Path, newest: int) -> None:
    steps = [m.step for m in complete(root)]
    keep = set(sorted(steps, reverse=True)[:KEEP])
    for folder in root.glob("step-*"):
        step = step_of(folder)
        if step is not None and step < newest and step not in keep and not newer(folder):
            shutil.rmtree(folder, ignore_errors=True)


def describe(model: ModelSpec, num_stages: int, optimizer: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the model, the stage count, the optimizer.
    The model's automatic cut is a list, as JSON reads it back, and only where there is one
    (a checkpoint written before ``ModelSpec.cut`` existed still resumes)."""
    spec = asdict(model)
    cut = spec.pop("cut")
    return {"model": spec | ({"cut": list(cut)} if cut else {}), "stages": num_stages,
            "optimizer": optimizer}


def check_meta(manifest: Manifest, meta: Mapping[str, Any]) -> None:
    """A ``ConfigError`` naming what differs between the checkpoint and this run."""
    for key, want in meta.items():
        got = manifest.meta.get(key)
        if got != want:
            raise ConfigError(f"checkpoint {manifest.path} was written for {key} {got}, this "
                              f"run has {want}; use another --checkpoint-dir or the same "
                              f"{key}")


def load_stages(manifest: Manifest, stages: Stages, opt: torch.optim.Optimizer) -> None:
    """Load this rank's stages (parameters, optimizer state) from ``manifest``, and the RNG
    state saved with the lowest of them."""
    for s in sorted(stages):
        if s not in manifest.files:
            raise ConfigError(f"checkpoint {manifest.path} has no stage {s}")
        path = manifest.path / manifest.files[s]
        data = read_stage(path, s, manifest.step)
        _load_stage(stages[s], opt, data, path)
        if s == min(stages):
            try:
                set_rng_state(data["rng"])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise ConfigError(f"checkpoint file {path} refused: its RNG state cannot be "
                                  f"restored ({type(exc).__name__})") from None


def read_stage(path: Path, stage: int, step: int) -> dict[str, Any]:
    """The content of stage file ``path`` (plain data only: ``weights_only``), which must be
    stage ``stage``'s at ``step``; a ``ConfigError`` naming the file and the reason if not."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to read is this file's fault
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
        raise ConfigError(f"checkpoint file {path} refused: not a plain-data stage file "
                          f"({type(exc).__name__}: {first})") from None
    keys = ("format", "stage", "step", "rng", "params", "optim")
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise ConfigError(f"checkpoint file {path} refused: it lacks the entries {keys}")
    if (data["format"], data["stage"], data["step"]) != (FORMAT, stage, step):
        raise ConfigError(f"checkpoint file {path} refused: it holds stage {data['stage']!r} "
                          f"at step {data['step']!r} (format {data['format']!r}), the manifest "
                          f"says stage {stage} at step {step}")
    return data


def _load_stage(stage: StageModule, opt: torch.optim.Optimizer, data: Mapping[str, Any],
                path: Path) -> None:
    named = stage.named_global_parameters()
    saved, optim = data["params"], data["optim"]
    if not isinstance(saved, dict) or not isinstance(optim, dict) or not all(
            isinstance(t, torch.Tensor) for t in saved.values()):
        raise ConfigError(f"checkpoint file {path} refused: its params or optim entry is not "
                          f"a table of tensors")
    wrong = sorted(n for n in set(named) | set(saved)
                   if n not in named or n not in saved or named[n].shape != saved[n].shape)
    if wrong:
        raise ConfigError(f"checkpoint {path} does not fit this run's stage: parameters "
                          f"{wrong[:4]} differ (another partition or model?)")
    if any(n not in named or not isinstance(st, dict) for n, st in optim.items()):
        raise ConfigError(f"checkpoint file {path} refused: optimizer state of unknown "
                          f"parameters")
    bad = first_nonfinite(_tensors(data))
    if bad is not None:
        raise ConfigError(f"checkpoint file {path} refused: {bad} holds non-finite values "
                          f"(written by an older FlexPipe, or by hand?); move that checkpoint "
                          f"away to resume from the one before")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(saved[name])
    for name, state in optim.items():
        opt.state[named[name]] = dict(state)


@dataclass(frozen=True)
class Checkpointer:
    """Checkpointing of one rank of a run: resume from the newest complete checkpoint, and
    write one every ``every`` steps (0: only after the last step) and after the last step."""

    root: Path
    every: int
    steps: int
    rank: int
    replica: int
    num_stages: int
    meta: dict[str, Any]
    timeout_s: float

    def resume(self, stages: Stages, opt: torch.optim.Optimizer) -> int:
        """Load the newest intact checkpoint, if any; the step to start at. Rank 0 says on
        stderr which checkpoint it used (or that it starts from scratch) and which newer ones
        it skipped and why; a checkpoint of another model, or past this run's steps, is
        refused (``ConfigError``)."""
        manifest, skipped = find(self.root)
        start = 0 if manifest is None else manifest.step
        ckdir.in_the_way(self.root, ckdir.plan_for(0, start, self.steps, self.every,
                                                   self.num_stages))
        for line in skipped:
            self._say(line)
        if manifest is None:
            self._say(f"no usable checkpoint in {self.root}: starting from scratch")
            return 0
        check_meta(manifest, self.meta)
        if manifest.step > self.steps:
            raise ConfigError(f"checkpoint {manifest.path} is at step {manifest.step}, past "
                              f"this run's {self.steps} steps; give --steps >= {manifest.step} "
                              f"or another --checkpoint-dir")
        load_stages(manifest, stages, opt)
        done = " (every step already done)" if manifest.step == self.steps else ""
        self._say(f"resuming from {manifest.path} (step {manifest.step} of {self.steps})"
                  f"{done}")
        return manifest.step

    def _check_room(self, done: int, stages: Stages, opt: torch.optim.Optimizer) -> None:
        """Collective: a ``RunError`` on every rank, before any file is written, when the
        stage files that the writers (replica 0) are about to write do not fit in the space
        free on the fullest rank's file system."""
        from flexpipe.runtime.transport import comm

        mine = payload_bytes(stages, opt) if self.replica == 0 else 0
        every = comm.all_gather_object((mine, ckdir.free_space(self.root)))
        problem = ckdir.room(self.root, sum(n for n, _ in every), min(f for _, f in every),
                             done)
        if problem is not None:
            raise RunError(problem)

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {line}", file=sys.stderr, flush=True)

    def after(self, step: int, stages: Stages, opt: torch.optim.Optimizer) -> None:
        """After ``step`` ran: write a checkpoint when one is due (every rank calls this)."""
        from flexpipe.runtime.transport import comm

        done = step + 1
        if not ckdir.is_due(done, self.steps, self.every):
            return
        self._check_room(done, stages, opt)
        if self.replica == 0:
            save_stages(self.root, done, stages, opt)
        comm.barrier(self.timeout_s)
        if self.rank == 0:
            write_manifest(self.root, done, self.num_stages, self.meta)
