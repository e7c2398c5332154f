"""Reading the manifest of a ``flexpipe run`` checkpoint folder (``step-NNNNNNNN``) and checking
it before anything is loaded. Two formats:

- ``dcp`` (what this FlexPipe writes): a torch.distributed.checkpoint folder whose
  ``flexpipe-manifest.json`` (``saved``) lists every file with its writer, size and SHA-256 and
  records the step, the data position in global samples, the layout that wrote it and the
  ranks' random-number states;
- ``stages`` (what FlexPipe wrote before, read to resume once): one ``torch.save`` file per
  stage and ``manifest.json`` (format 2) with their sizes and SHA-256.

A checkpoint is used only when its step is its folder's, its files are the ones its manifest
lists and each has its recorded size and SHA-256 (``inspect``); ``find`` skips one that fails,
naming the file and the reason, and tries the next older one. Plain files and JSON only: no
torch here, so the launcher can look before any rank starts (``resume_point``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexpipe.errors import ConfigError
from flexpipe.runtime.processes import saved
from flexpipe.runtime.processes.ckdir import MANIFEST, stage_file

FORMAT = 2
"""The format of the older per-stage checkpoints (``manifest.json``), read to resume only."""
DCP, STAGES = "dcp", "stages"
"""The two kinds of checkpoint folder."""


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: where it is, the next step to run, its ``kind`` (``dcp`` or the
    older ``stages``), what it was written for (model description, optimizer, data), its
    files (by stage for ``stages``) and the whole manifest ``body``."""

    path: Path
    step: int
    files: dict[int, str]
    meta: dict[str, Any]
    kind: str = DCP
    body: dict[str, Any] = field(default_factory=dict, compare=False)


def step_of(folder: Path) -> int | None:
    """The step a folder named ``step-NNNNNNNN`` holds (None: not such a name)."""
    digits = folder.name.removeprefix("step-")
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 12 else None


def _json(path: Path) -> dict[str, Any] | str:
    """The JSON object in ``path``, or why it cannot be read."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"{path.name} cannot be read ({type(exc).__name__})"
    return body if isinstance(body, dict) else f"{path.name} is not a JSON object"


def _dcp(folder: Path) -> Manifest | str:
    """The DCP checkpoint in ``folder`` by its manifest (files not hashed), or what is wrong."""
    body = saved.manifest(folder)
    if isinstance(body, str):
        return body
    step, meta, samples = body.get("step"), body.get("meta"), body.get("samples")
    if not isinstance(step, int) or step != step_of(folder):
        return f"{saved.MANIFEST} says step {step!r}, its folder is {folder.name}"
    if not isinstance(meta, dict) or not isinstance(samples, int) or samples < 0:
        return f"{saved.MANIFEST} has no meta table or data position (not written by " \
               f"flexpipe run: a Pipeline.save folder?)"
    return Manifest(folder, step, {}, meta, DCP, body)


def _stages(folder: Path) -> Manifest | str:
    """The older per-stage checkpoint in ``folder`` (files not hashed), or what is wrong."""
    if not (folder / MANIFEST).is_file():
        return f"no {MANIFEST} (unfinished: the run stopped while writing it)"
    body = _json(folder / MANIFEST)
    if isinstance(body, str):
        return body
    if body.get("format") != FORMAT:
        return f"{MANIFEST} has format {body.get('format')!r}, this FlexPipe reads {FORMAT}"
    step, meta, files = body.get("step"), body.get("meta"), body.get("files")
    if not isinstance(step, int) or step != step_of(folder):
        return f"{MANIFEST} says step {step!r}, its folder is {folder.name}"
    if not isinstance(meta, dict) or not isinstance(files, dict):
        return f"{MANIFEST} has no meta or files table"
    stages = meta.get("stages")
    want = {str(s): stage_file(s) for s in range(stages)} if isinstance(stages, int) else None
    if files != want:
        return f"{MANIFEST} lists files {sorted(map(str, files.values()))[:4]}, not the " \
               f"stage files of its {stages!r} stages"
    return Manifest(folder, step, {int(s): name for s, name in files.items()}, meta, STAGES,
                    body)


def _stage_damage(manifest: Manifest, names: list[str]) -> str | None:
    """Why one of the stage files ``names`` differs from the manifest (None: all intact)."""
    sizes, digests = manifest.body.get("sizes"), manifest.body.get("sha256")
    if not isinstance(sizes, dict) or not isinstance(digests, dict):
        return f"{MANIFEST} has no sizes or sha256 table"
    for name in names:
        path = manifest.path / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != sizes.get(name):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {sizes.get(name)}"
        if saved.sha256(path) != digests.get(name):
            return f"{name} does not match its SHA-256 in the manifest (damaged or altered)"
    return None


def damage(manifest: Manifest, rank: int = 0, world: int = 1) -> str | None:
    """Rank ``rank``'s share (of ``world``) of the check of the checkpoint's files against its
    manifest: the first that differs, named (None: this share is intact)."""
    if manifest.kind == DCP:
        found = saved.damage(manifest.path, manifest.body, rank, world)
        return None if found is None else found.removeprefix(f"{manifest.path}/")
    return _stage_damage(manifest, sorted(manifest.files.values())[rank::max(world, 1)])


def inspect(folder: Path, verify: bool = True) -> Manifest | str:
    """The checkpoint in ``folder`` if it is complete, consistent and (with ``verify``) every
    file matches its size and SHA-256; otherwise the reason, naming the file. A folder with
    a DCP manifest is read as DCP, else as the older per-stage format."""
    manifest = _dcp(folder) if (folder / saved.MANIFEST).is_file() else _stages(folder)
    if isinstance(manifest, str) or not verify:
        return manifest
    problem = damage(manifest)
    return manifest if problem is None else problem


def _folders(root: Path) -> list[Path]:
    """Checkpoint folders under ``root``, newest step first."""
    found = [(step, f) for f in root.glob("step-*")
             if f.is_dir() and (step := step_of(f)) is not None]
    return [f for _, f in sorted(found, reverse=True)]


def complete(root: Path) -> list[Manifest]:
    """Complete checkpoints by their manifests alone (files not hashed), oldest first."""
    found = [inspect(f, verify=False) for f in _folders(root)]
    return sorted((m for m in found if isinstance(m, Manifest)), key=lambda m: m.step)


def newer(folder: Path) -> int | None:
    """The format of ``folder``'s manifest when it is newer than this FlexPipe reads (a
    checkpoint it cannot read, so must never overwrite or delete); else None."""
    for name, mine in ((saved.MANIFEST, saved.FORMAT), (MANIFEST, FORMAT)):
        body = _json(folder / name) if (folder / name).is_file() else None
        found = body.get("format") if isinstance(body, dict) else None
        if isinstance(found, int) and not isinstance(found, bool) and found > mine:
            return found
    return None


Check = Callable[[Manifest], str | None]
"""Why a checkpoint's files differ from its manifest (None: intact)."""


def find(root: str | Path, check: Check = damage) -> tuple[Manifest | None, list[str]]:
    """The newest intact checkpoint under ``root`` (None: none), and one line per newer
    checkpoint skipped, naming its folder and why; ``check`` tells whether its files are intact
    (the ranks of a run share the work: ``Checkpointer``). A checkpoint of a newer manifest
    format than this FlexPipe reads is a ``ConfigError`` (it would be overwritten or pruned)."""
    skipped: list[str] = []
    folders = _folders(Path(root)) if Path(root).is_dir() else []
    later = [(f, n) for f in folders if (n := newer(f)) is not None]
    if later:
        raise ConfigError(f"checkpoint {later[0][0]} has manifest format {later[0][1]}, this "
                          f"FlexPipe reads formats up to {saved.FORMAT} (DCP) and {FORMAT} "
                          "(per stage), written by a newer FlexPipe: the run refuses to "
                          "start, since its own checkpoints would overwrite or prune it; "
                          "resume it with that FlexPipe, or give another --checkpoint-dir")
    for folder in folders:
        found = inspect(folder, verify=False)
        problem = found if isinstance(found, str) else check(found)
        if isinstance(found, Manifest) and problem is None:
            return found, skipped
        skipped.append(f"skipped {folder}: {problem}")
    return None, skipped


def latest(root: str | Path) -> Manifest | None:
    """The newest intact checkpoint under ``root`` (None: there is none)."""
    return find(root)[0]


def files_of(manifest: Manifest) -> list[str]:
    """The names of the checkpoint's files."""
    if manifest.kind == DCP:
        return sorted(manifest.body.get("files", {}))
    return sorted(manifest.files.values())


def resume_point(root: str | Path) -> tuple[int, int]:
    """The step of the newest complete checkpoint under ``root`` by its manifest (files not
    hashed: a first look before the ranks start) and its files' bytes; (0, 0): none."""
    found = complete(Path(root)) if Path(root).is_dir() else []
    if not found:
        return 0, 0
    newest = found[-1]
    return newest.step, sum((newest.path / name).stat().st_size for name in files_of(newest)
                            if (newest.path / name).is_file())


