"""Reading a checkpoint's manifest (``manifest.json``, written last: the checkpoint is complete
once it exists) and checking it before anything is loaded: its step is its folder's, its files
are exactly the stage files of the stage count it records, and each file has its recorded size
and SHA-256 (``inspect``); ``find`` skips a checkpoint that fails one, naming the file and the
reason, and tries the next older one. Plain files and JSON only: no torch here, so the launcher
can look before any rank starts (``resume_point``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from flexpipe.errors import ConfigError
from flexpipe.runtime.processes.ckdir import MANIFEST, stage_file

FORMAT = 2
"""The checkpoint format this FlexPipe writes and reads."""


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: where it is, the next step to run, its stage files (by stage)
    and what it was written for (model description, optimizer)."""

    path: Path
    step: int
    files: dict[int, str]
    meta: dict[str, Any]


def step_of(folder: Path) -> int | None:
    """The step a folder named ``step-NNNNNNNN`` holds (None: not such a name)."""
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
    if not isinstance(step, int) or step != step_of(folder):
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
    """The format of ``folder``'s manifest when it is newer than this FlexPipe's (a checkpoint
    it cannot read, so must never overwrite or delete); else None."""
    try:
        found = json.loads((folder / MANIFEST).read_text(encoding="utf-8")).get("format")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError):
        return None
    return found if isinstance(found, int) and not isinstance(found, bool) and \
        found > FORMAT else None


def find(root: str | Path) -> tuple[Manifest | None, list[str]]:
    """The newest intact checkpoint under ``root`` (None: none), and one line per newer
    checkpoint skipped, naming its folder and why; a checkpoint of a newer manifest format
    than this FlexPipe reads is a ``ConfigError`` (it would be overwritten or pruned)."""
    skipped: list[str] = []
    folders = _folders(Path(root)) if Path(root).is_dir() else []
    later = [(f, n) for f in folders if (n := newer(f)) is not None]
    if later:
        raise ConfigError(f"checkpoint {later[0][0]} has manifest format {later[0][1]}, this "
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


def resume_point(root: str | Path) -> tuple[int, int]:
    """The step of the newest complete checkpoint under ``root`` by its manifest (files not
    hashed: a first look before the ranks start) and its stage files' bytes; (0, 0): none."""
    found = complete(Path(root)) if Path(root).is_dir() else []
    if not found:
        return 0, 0
    newest = found[-1]
    return newest.step, sum((newest.path / name).stat().st_size
                            for name in newest.files.values() if (newest.path / name).is_file())


def sha256(path: Path) -> str:
    """The SHA-256 digest of the file at ``path`` (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(partial(f.read, 1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
