"""The folder of a DCP checkpoint (``Pipeline.save``/``load`` and ``flexpipe run``'s
``step-NNNNNNNN`` folders, ``dcp``): written whole or not at all, and checked before it is
read.

A save writes to a new sibling folder (``.NAME.saving``); once every rank has written its
torch.distributed.checkpoint (DCP) files, each hashes its own (``__R_*.distcp``, rank 0 also
DCP's ``.metadata``), rank 0 writes ``MANIFEST`` (every file's writer rank, size and SHA-256,
the optimizer's class) and one atomic rename makes the folder ``NAME`` (an exchange with the
previous checkpoint, which is then deleted): until that rename the previous checkpoint is
there, complete, and a save cut short leaves it as it was (the next save removes the
unfinished folder). A folder at ``NAME`` that is not a FlexPipe checkpoint is never replaced.

Before a load, every file the manifest lists is checked for its size and SHA-256 (the ranks
share the files between them), so a damaged or truncated file is refused naming it and the
rank that wrote it; a manifest of a newer format, or none, is refused saying so.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

MANIFEST = "flexpipe-manifest.json"
FORMAT = 1
"""The manifest format this FlexPipe writes and reads (a higher one is refused)."""
METADATA = ".metadata"
"""DCP's own index of the checkpoint, written by rank 0."""
Files = dict[str, dict[str, Any]]
"""File name -> {"rank": writer, "bytes": size, "sha256": digest}."""


def staging(path: str | Path) -> Path:
    """The sibling folder a save of ``path`` writes before it is renamed into place."""
    p = Path(path)
    return p.with_name(f".{p.name}.saving")


def prepare(path: str | Path) -> str | None:
    """Rank 0, before a save: why ``path`` may not be written (None: it may), after removing
    what an unfinished save left (its staging folder)."""
    p = Path(path)
    if p.exists() and not (p / MANIFEST).is_file() and (not p.is_dir() or any(p.iterdir())):
        return (f"{p} exists and is not a FlexPipe checkpoint (no {MANIFEST}): it is not "
                "replaced; save to another path or move it away")
    try:
        if staging(p).exists():
            shutil.rmtree(staging(p))
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot prepare {staging(p)}: {exc}"
    return None


def own_files(folder: Path, rank: int) -> Files | str:
    """The DCP files rank ``rank`` wrote in ``folder`` with their sizes and digests (rank 0:
    also ``.metadata``), or why they cannot be read."""
    names = sorted(f.name for f in folder.glob(f"__{rank}_*.distcp"))
    names += [METADATA] if rank == 0 else []
    try:
        return {n: {"rank": rank, "bytes": (folder / n).stat().st_size,
                    "sha256": sha256(folder / n)} for n in names}
    except OSError as exc:
        return f"cannot hash what it wrote in {folder}: {exc}"


def publish(folder: Path, path: str | Path, files: Files, optimizer: str | None,
            extra: Mapping[str, Any] | None = None) -> None:
    """Rank 0, once every rank has written and hashed its files: the manifest (with the JSON
    fields ``extra``), then one rename that makes ``folder`` the checkpoint ``path`` (the
    previous one deleted after)."""
    body = {**(extra or {}), "format": FORMAT, "files": files, "optimizer": optimizer}
    tmp = folder / f"{MANIFEST}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    target = Path(path)
    if target.exists():
        _exchange(folder, target)
        shutil.rmtree(folder, ignore_errors=True)  # now the previous checkpoint
    else:
        os.rename(folder, target)
    _sync_dir(target.parent)


def _exchange(a: Path, b: Path) -> None:
    """Swap two folders in one atomic ``renameat2(RENAME_EXCHANGE)``; where the system has
    none, two renames (the previous checkpoint kept as ``.NAME.replaced`` between them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "renameat2", None)
    if call is not None and call(-100, bytes(a), -100, bytes(b), 2) == 0:  # AT_FDCWD, EXCHANGE
        return
    code = ctypes.get_errno() if call is not None else errno.ENOSYS
    if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        raise OSError(code, f"cannot exchange {a} and {b}: {os.strerror(code)}")
    old = replaced(b)
    os.rename(b, old)
    os.rename(a, b)
    os.rename(old, a)


def replaced(path: str | Path) -> Path:
    """Where the previous checkpoint is while a save without an atomic exchange replaces it."""
    p = Path(path)
    return p.with_name(f".{p.name}.replaced")


def _sync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest(path: str | Path) -> dict[str, Any] | str:
    """The checkpoint's manifest, or why there is none this FlexPipe reads."""
    p = Path(path)
    if not (p / MANIFEST).is_file():
        if replaced(p).is_dir():
            return (f"no checkpoint at {p}: a save was replacing it; the previous one is "
                    f"{replaced(p)} (rename it back)")
        what = "no such folder" if not p.exists() else f"no {MANIFEST}: not written by " \
            "Pipeline.save, or an unfinished save"
        return f"no checkpoint at {p} ({what})"
    try:
        body = json.loads((p / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"{p / MANIFEST} cannot be read ({type(exc).__name__})"
    if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
        return f"{p / MANIFEST} is not a FlexPipe manifest (no files table)"
    if isinstance(body.get("format"), bool) or body.get("format") != FORMAT:
        return (f"{p / MANIFEST} has format {body.get('format')!r}; this FlexPipe reads format "
                f"{FORMAT} (written by another FlexPipe version?)")
    return body


def damage(path: str | Path, body: Mapping[str, Any], rank: int, world: int) -> str | None:
    """This rank's share of the check of every file the manifest lists (size, SHA-256): the
    first one that differs, named with the rank that wrote it (None: this share is intact)."""
    files = body["files"]
    for name in sorted(files)[rank::max(world, 1)]:
        entry, file = files[name], Path(path) / name
        writer = entry.get("rank") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or "/" in name or name.startswith(".."):
            return f"{Path(path) / MANIFEST} has a bad entry for {name!r}"
        if not file.is_file():
            return f"{file} (written by rank {writer}) is missing"
        size = file.stat().st_size
        if size != entry.get("bytes"):
            return (f"{file} (written by rank {writer}) has {size} bytes, the manifest says "
                    f"{entry.get('bytes')} (truncated or replaced)")
        if sha256(file) != entry.get("sha256"):
            return (f"{file} (written by rank {writer}) does not match its SHA-256 in the "
                    "manifest (damaged or altered)")
    return None


def sha256(path: Path) -> str:
    """The SHA-256 digest of the file at ``path`` (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(partial(f.read, 1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
