"""Checkpoints of a pipeline training run, keyed by *stage* so that a run can resume onto any
schedule with the same stages and partition (another schedule family, another placement).

Layout under the checkpoint directory::

    step-00000004/stage-0.pt      parameters + optimizer state of stage 0 (by global name),
    step-00000004/stage-1.pt      the RNG state of the rank that held it, the step
    step-00000004/manifest.json   written last: the checkpoint is complete once it exists

Every file is written to a temporary name and renamed into place (``os.replace``), and the
manifest (file names, sizes and SHA-256 digests, the model, the step) only after every rank has
written its stages, so a checkpoint cut short by a crash is never picked up. Before a checkpoint
is used, every check is made (``inspect``): the manifest's step is its folder's, its files are
exactly the stage files of the stage count it records, and each file has its recorded size and
SHA-256; a checkpoint that fails one is skipped with the file and the reason (``find``), and
the next older one is tried. Each stage file is then read with ``torch.load(weights_only=True)``
(loading never executes code: a payload that would is refused) and must hold the stage and step
the manifest says. The data position is the step itself (a step's micro-batches are a pure
function of the step), saved as the manifest's ``step`` (the next step to run). With
data-parallel replicas only replica 0 writes (replicas are identical).
"""

from __future__ import annotations

import hashlib
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
from flexpipe.runtime.processes.ckdir import write_error
from flexpipe.runtime.processes.numerics import check_finite, first_nonfinite
from flexpipe.runtime.processes.rngstate import rng_state, set_rng_state

FORMAT = 2
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


def sha256(path: Path) -> str:
    """The SHA-256 digest of the file at ``path`` (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(partial(f.read, 1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stage_file(stage: int) -> str:
    """The one name the file of ``stage`` may have (a manifest naming another is refused)."""
    return f"stage-{stage}.pt"


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
    complete = [m.step for m in _manifests(root)]
    keep = set(sorted(complete, reverse=True)[:KEEP])
    for folder in root.glob("step-*"):
        step = _step_of(folder)
        if step is not None and step < newest and step not in keep and not _newer(folder):
            shutil.rmtree(folder, ignore_errors=True)


def _newer(folder: Path) -> int | None:
    """The format of ``folder``'s manifest when it is newer than this FlexPipe's (a checkpoint
    it cannot read, so must never overwrite or delete); else None."""
    try:
        found = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("format")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        return None
    return found if isinstance(found, int) and not isinstance(found, bool) and \
        found > FORMAT else None


def _step_of(folder: Path) -> int | None:
    digits = folder.name.removeprefix("step-")
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 12 else None


def _body(folder: Path) -> dict[str, Any] | str:
    """The manifest of ``folder`` as a dict, or why it cannot be read."""
    path = folder / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} (unfinished: the run stopped while writing it)"
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"{MANIFEST} cannot be read ({type(exc).__name__})"
    if not isinstance(body, dict):
        return f"{MANIFEST} is not a JSON object"
    if body.get("format") != FORMAT:
        return f"{MANIFEST} has format {body.get('format')!r}, this FlexPipe reads {FORMAT}"
    return body


def _header(folder: Path, body: dict[str, Any]) -> Manifest | str:
    """The manifest's step, files and meta, checked against its folder; or what is wrong."""
    step, meta, files = body.get("step"), body.get("meta"), body.get("files")
    if not isinstance(step, int) or step != _step_of(folder):
        return f"{MANIFEST} says step {step!r}, its folder is {folder.name}"
    if not isinstance(meta, dict) or not isinstance(files, dict):
        return f"{MANIFEST} has no meta or files table"
    stages = meta.get("stages")
    want = {str(s): stage_file(s) for s in range(stages)} if isinstance(stages, int) else None
    if files != want:
        return f"{MANIFEST} lists files {sorted(map(str, files.values()))[:4]}, not the " \
               f"stage files of its {stages!r} stages"
    return Manifest(folder, step, {int(s): name for s, name in files.items()}, meta)


def _damage(folder: Path, body: dict[str, Any], names: list[str]) -> str | None:
    """Why one of the stage files ``names`` differs from the manifest (None: all intact)."""
    sizes, digests = body.get("sizes"), body.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(digests, dict):
        return f"{MANIFEST} has no sizes or sha256 table"
    for name in names:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != sizes.get(name):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {sizes.get(name)}"
        if sha256(path) != digests.get(name):
            return f"{name} does not match its SHA-256 in the manifest (damaged or altered)"
    return None


def inspect(folder: Path, verify: bool = True) -> Manifest | str:
    """The checkpoint in ``folder`` if it is complete, consistent and (with ``verify``) every
    file matches its size and SHA-256; otherwise the reason, naming the file."""
    body = _body(folder)
    if isinstance(body, str):
        return body
    manifest = _header(folder, body)
    if isinstance(manifest, str) or not verify:
        return manifest
    damage = _damage(folder, body, list(manifest.files.values()))
    return manifest if damage is None else damage


def read_manifest(folder: Path) -> Manifest | None:
    """The checkpoint in ``folder`` when it is complete and intact (``inspect``); else None."""
    found = inspect(folder)
    return found if isinstance(found, Manifest) else None


def _folders(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest step first."""
    found = [(step, f) for f in root.glob("step-*")
             if f.is_dir() and (step := _step_of(f)) is not None]
    return [f for _, f in sorted(found, reverse=True)]


def _manifests(root: Path) -> list[Manifest]:
    """Complete checkpoints by their manifests alone (files not hashed), oldest first."""
    found = [inspect(f, verify=False) for f in _folders(root)]
    return sorted((m for m in found if isinstance(m, Manifest)), key=lambda m: m.step)


def find(root: str | Path) -> tuple[Manifest | None, list[str]]:
    """The newest intact checkpoint under ``root`` (None: none), and one line per newer
    checkpoint skipped, naming its folder and why; a checkpoint of a newer manifest format
    than this FlexPipe reads is a ``ConfigError`` (it would be overwritten or pruned)."""
    skipped: list[str] = []
    folders = _folders(Path(root)) if Path(root).is_dir() else []
    newer = [(f, n) for f in folders if (n := _newer(f)) is not None]
    if newer:
        raise ConfigError(f"checkpoint {newer[0][0]} has manifest format {newer[0][1]}, this "
                          f"FlexPipe reads format {FORMAT} (written by a newer FlexPipe): the "
                          "run refuses to start, since its own checkpoints would overwrite or "
                          "prune it; resume it with that FlexPipe, or give another "
                          "--checkpoint-dir")
    for folder in folders:
        found = inspect(folder)
        if isinstance(found, Manifest):
            return found, skipped
        skipped.append(f"skipped {folder}: {found}")
    return None, skipped


def latest(root: str | Path) -> Manifest | None:
    """The newest intact checkpoint under ``root`` (None: there is none)."""
    return find(root)[0]


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
    bad = first_nonfinite(saved)
    if bad is not None:
        raise ConfigError(f"checkpoint file {path} refused: parameter {bad} holds non-finite "
                          f"values (written by an older FlexPipe?); move that checkpoint "
                          f"away to resume from the one before")
    if any(n not in named or not isinstance(st, dict) for n, st in optim.items()):
        raise ConfigError(f"checkpoint file {path} refused: optimizer state of unknown "
                          f"parameters")
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

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(f"checkpoint: {line}", file=sys.stderr, flush=True)

    def after(self, step: int, stages: Stages, opt: torch.optim.Optimizer) -> None:
        """After ``step`` ran: write a checkpoint when one is due (every rank calls this)."""
        from flexpipe.runtime.transport import comm

        done = step + 1
        if done != self.steps and (self.every <= 0 or done % self.every):
            return
        if self.replica == 0:
            save_stages(self.root, done, stages, opt)
        comm.barrier(self.timeout_s)
        if self.rank == 0:
            write_manifest(self.root, done, self.num_stages, self.meta)
