"""Checkpoints of a pipeline training run, keyed by *stage* so that a run can resume onto any
schedule with the same stages and partition (another schedule family, another placement).

Layout under the checkpoint directory::

    step-00000004/stage-0.pt      parameters + optimizer state of stage 0 (by global name),
    step-00000004/stage-1.pt      the RNG state of the rank that held it, the step
    step-00000004/manifest.json   written last: the checkpoint is complete once it exists

Every file is written to a temporary name and renamed into place (``os.replace``), and the
manifest (file names and sizes, the model, the step) only after every rank has written its
stages, so a checkpoint cut short by a crash is never picked up: ``latest`` skips it and
returns the newest complete one. Files are read with ``torch.load(weights_only=True)`` and
``json``: loading never executes code. The data position is the step itself (a step's
micro-batches are a pure function of the step), saved as the manifest's ``step`` (the next
step to run). With data-parallel replicas only replica 0 writes (replicas are identical).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.models import ModelSpec
from flexpipe.runtime.stage import StageModule

FORMAT = 1
MANIFEST = "manifest.json"
KEEP = 2
"""Complete checkpoints kept (older ones are deleted once a newer one is complete)."""

Stages = Mapping[int, StageModule]


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: where it is, the next step to run, its stage files (by stage)
    and what it was written for (model description, optimizer)."""

    path: Path
    step: int
    files: dict[int, str]
    meta: dict[str, Any]


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken before ``step`` runs."""
    return Path(root) / f"step-{step:08d}"


def _atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write ``path`` through a temporary file in the same directory, synced, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a crash
    finally:
        os.close(folder)


def _save(payload: dict[str, Any], path: Path) -> None:
    torch.save(payload, path)


def rng_state() -> dict[str, Any]:
    """This process's torch and Python RNG states, as plain data (tensors, lists, ints)."""
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


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
        _atomic(folder / f"stage-{s}.pt", partial(_save, payload))


def write_manifest(root: str | Path, step: int, num_stages: int, meta: Mapping[str, Any]) -> Path:
    """Complete the checkpoint of ``step`` (every stage file must be written), then delete all
    but the newest ``KEEP`` complete checkpoints and any unfinished older one."""
    folder = step_dir(root, step)
    files = {str(s): f"stage-{s}.pt" for s in range(num_stages)}
    missing = [name for name in files.values() if not (folder / name).is_file()]
    if missing:
        raise ConfigError(f"checkpoint {folder}: stage files {missing} were not written (is "
                          f"the checkpoint directory shared by every rank?)")
    body = {"format": FORMAT, "step": step, "files": files, "meta": dict(meta),
            "sizes": {name: (folder / name).stat().st_size for name in files.values()}}
    _atomic(folder / MANIFEST, lambda tmp: tmp.write_text(json.dumps(body, indent=1)))
    _prune(Path(root), step)
    return folder


def _prune(root: Path, newest: int) -> None:
    complete = [m.step for m in _scan(root)]
    keep = set(sorted(complete, reverse=True)[:KEEP])
    for folder in root.glob("step-*"):
        step = _step_of(folder)
        if step is not None and step < newest and step not in keep:
            shutil.rmtree(folder, ignore_errors=True)


def _step_of(folder: Path) -> int | None:
    digits = folder.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else None


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest of ``folder`` when the checkpoint there is complete and intact (every
    listed file present with its recorded size); None otherwise."""
    try:
        body = json.loads((folder / MANIFEST).read_text())
        files = {int(s): str(name) for s, name in body["files"].items()}
        sizes = {str(k): int(v) for k, v in body["sizes"].items()}
        if body["format"] != FORMAT or not isinstance(body["meta"], dict):
            return None
        intact = all((folder / name).is_file()
                     and (folder / name).stat().st_size == sizes.get(name) for name in
                     files.values())
        return Manifest(folder, int(body["step"]), files, body["meta"]) if intact else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _scan(root: Path) -> list[Manifest]:
    found = [read_manifest(folder) for folder in root.glob("step-*") if folder.is_dir()]
    return sorted((m for m in found if m is not None), key=lambda m: m.step)


def latest(root: str | Path) -> Manifest | None:
    """The newest complete checkpoint under ``root`` (None: there is none)."""
    found = _scan(Path(root)) if Path(root).is_dir() else []
    return found[-1] if found else None


def describe(model: ModelSpec, num_stages: int, optimizer: str) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the model, the stage count, the optimizer."""
    return {"model": asdict(model), "stages": num_stages, "optimizer": optimizer}


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
        data = torch.load(path, map_location="cpu", weights_only=True)
        _load_stage(stages[s], opt, data, path)
        if s == min(stages):
            set_rng_state(data["rng"])


def _load_stage(stage: StageModule, opt: torch.optim.Optimizer, data: Mapping[str, Any],
                path: Path) -> None:
    named = stage.named_global_parameters()
    saved: Mapping[str, torch.Tensor] = data["params"]
    wrong = sorted(n for n in set(named) | set(saved)
                   if n not in named or n not in saved or named[n].shape != saved[n].shape)
    if wrong:
        raise ConfigError(f"checkpoint {path} does not fit this run's stage: parameters "
                          f"{wrong[:4]} differ (another partition or model?)")
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(saved[name])
    for name, state in data["optim"].items():
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
        """Load the newest complete checkpoint, if any; the step to start at."""
        manifest = latest(self.root)
        if manifest is None:
            return 0
        check_meta(manifest, self.meta)
        load_stages(manifest, stages, opt)
        return manifest.step

    def after(self, step: int, stages: Stages, opt: torch.optim.Optimizer) -> None:
        """After ``step`` ran: write a checkpoint when one is due (every rank calls this)."""
        from flexpipe.runtime import comm

        done = step + 1
        if done != self.steps and (self.every <= 0 or done % self.every):
            return
        if self.replica == 0:
            save_stages(self.root, done, stages, opt)
        comm.barrier(self.timeout_s)
        if self.rank == 0:
            write_manifest(self.root, done, self.num_stages, self.meta)
