"""The checkpoint directory, checked before training rather than at the first checkpoint:

- it exists or can be made, and a file can be written in it (a read-only directory used to
  fail only after the training it was meant to keep);
- it has room for one more checkpoint (``checkpoint_bytes``: weights plus optimizer state),
  when the run will write one (``Plan.due``); a run that resumes from a complete checkpoint is
  not refused for space: it is told, and each checkpoint is checked again just before it is
  written (``room``), so a full disk is refused before a byte of it is written;
- nothing in the way of the folders this run will write (``step-00000004`` as a file, a
  folder or a foreign file inside it): refused before training, naming the path
  (``in_the_way``);
- no other run holds it: ``LOCK`` (``.flexpipe.lock``) is held with ``fcntl.flock`` for the
  whole run and names the holder (pid, host, start time). The kernel drops the lock when its
  holder dies, so a lock file left by a dead run is *stale*: it is named and taken over, never
  raced (two runs cannot both hold it);
- the temporary files (``.NAME.tmpPID``) a killed run left in it are removed, once the lock is
  held;
- a write that fails (``ENOSPC`` and the like) is a ``RunError`` naming the file, the reason and
  the free space (``write_error``), not torch's zip-writer text.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flexpipe.errors import ConfigError, RunError

LOCK = ".flexpipe.lock"
"""The lock file under the checkpoint directory."""
MANIFEST = "manifest.json"
"""A checkpoint's manifest, written last: the checkpoint is complete once it exists."""
STATES = {"sgd": 1, "adamw": 2}
"""Optimizer state tensors per parameter (SGD's momentum; AdamW's two moments)."""


def state_copies(optimizer: str, momentum: float = 0.9) -> int:
    """Copies of a parameter ``optimizer`` keeps as its state (``STATES``; SGD without
    momentum keeps none)."""
    return 0 if optimizer == "sgd" and not momentum else STATES.get(optimizer, 2)


def checkpoint_bytes(params: int, dtype_bytes: int, optimizer: str) -> int:
    """Bytes one checkpoint takes: every parameter and its optimizer state."""
    return params * dtype_bytes * (1 + state_copies(optimizer))


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken before ``step`` runs."""
    return Path(root) / f"step-{step:08d}"


def stage_file(stage: int) -> str:
    """The one name the file of ``stage`` may have in the older per-stage format (a manifest
    naming another is refused)."""
    return f"stage-{stage}.pt"


def is_due(done: int, steps: int, every: int) -> bool:
    """Whether a run of ``steps`` steps writes a checkpoint once ``done`` steps are done:
    after every ``every``-th step (``every`` 0: none of them) and after the last one."""
    return done == steps or (every > 0 and done % every == 0)


@dataclass(frozen=True)
class Plan:
    """What a run will write under its checkpoint directory: ``need`` bytes a checkpoint
    (about), after each of the ``due`` steps; ``resume``: the step of the newest complete
    checkpoint there (0: none)."""

    need: int
    due: tuple[int, ...] = (1,)
    resume: int = 0


def plan_for(need: int, resume: int, steps: int, every: int) -> Plan:
    """The ``Plan`` of a run of ``steps`` steps resuming at ``resume`` (0: from scratch)."""
    due = tuple(d for d in range(resume + 1, steps + 1) if is_due(d, steps, every))
    return Plan(need, due, resume)


def _size(nbytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


@dataclass
class DirLock:
    """The held lock of a checkpoint directory (``release`` it, or use ``with``)."""

    path: Path
    fd: int

    def release(self) -> None:
        """Give the directory back (the lock file stays, unlocked and empty)."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _make(root: Path) -> None:
    """Make ``root`` and check a file can be written there."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".flexpipe-probe.tmp{os.getpid()}"
        probe.write_bytes(b"0")
        probe.unlink()
    except (OSError, ValueError) as exc:  # ValueError: a name the OS refuses (a NUL byte)
        raise ConfigError(f"--checkpoint-dir {str(root)!r} is not usable: cannot write in it "
                          f"({getattr(exc, 'strerror', None) or exc}); checked before "
                          f"training so that no training is lost") from None


def _holder(text: str) -> str:
    """The holder named in a lock file's text."""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if not fields:
        return "an unknown holder"
    when = fields.get("since", "")
    try:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(when)))
    except ValueError:
        pass
    return f"pid {fields.get('pid', '?')} on {fields.get('host', '?')} since {when}"


def lock(root: Path, say: Callable[[str], None]) -> DirLock:
    """Hold ``root``'s lock for this process; a ``ConfigError`` naming the holder when another
    live run holds it; a stale lock (its holder is gone) is named through ``say`` and taken
    over."""
    path = root / LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {str(root)!r}: cannot open its lock file "
                          f"{str(path)!r} ({exc.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        old = os.pread(fd, 4096, 0).decode(errors="replace")
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ConfigError(f"--checkpoint-dir {str(root)!r}: cannot lock {str(path)!r} "
                              f"({exc.strerror})") from None
        raise ConfigError(f"--checkpoint-dir {str(root)!r} is in use by another run "
                          f"({_holder(old)}, lock file {str(path)!r}); wait for it to end or "
                          f"use another directory") from None
    old = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    if old:
        say(f"took over the stale lock of {_holder(old)} (that run is gone)")
    mine = f"pid={os.getpid()} host={socket.gethostname()} since={time.time():.0f}\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, mine.encode(), 0)
    return DirLock(path, fd)


def clean_temporaries(root: Path) -> list[Path]:
    """Remove the temporary files (``.NAME.tmpPID``) left under ``root`` and its checkpoint
    folders by runs that were killed while writing; the files removed. Call it only while
    holding the lock."""
    removed = []
    for folder in [root, *sorted(root.glob("step-*"))]:
        for tmp in folder.glob(".*.tmp*") if folder.is_dir() else []:
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed


def check_space(root: Path, plan: Plan, say: Callable[[str], None]) -> None:
    """A ``ConfigError`` when the run will write a checkpoint and ``root``'s file system has
    less free space than one takes; a run resuming from a complete checkpoint is told instead
    (through ``say``) and goes on: each checkpoint is checked again before it is written."""
    free = shutil.disk_usage(root).free
    if not plan.due or free >= plan.need:
        return
    short = f"--checkpoint-dir {str(root)!r} has {_size(free)} free, one checkpoint needs " \
        f"about {_size(plan.need)} (weights and optimizer state)"
    if not plan.resume:
        raise ConfigError(f"{short}; free some space or use another directory")
    say(f"{short}: resuming from {step_dir(root, plan.resume)} all the same; the checkpoint "
        f"after step {plan.due[0]} is checked again just before it is written and refused "
        f"then (nothing of it written, step-{plan.resume:08d} kept) unless space was freed")


OWN = re.compile(r"stage-\d+\.pt|manifest\.json|flexpipe-manifest\.json|__\d+_\d+\.distcp|"
                 r"\.metadata|\..+\.tmp\d*")
"""The names of the files FlexPipe writes in a step folder (DCP's, the manifests, the older
per-stage files, temporaries)."""


def in_the_way(root: Path, plan: Plan) -> None:
    """A ``ConfigError`` naming a path where a checkpoint folder of ``plan`` will be written
    and something else is: a file (or link) named like a step folder, a folder inside one, or
    a file FlexPipe does not write. (A step folder holding only FlexPipe's files is what an
    interrupted or damaged checkpoint left: it is replaced.)"""
    for done in plan.due:
        folder = step_dir(root, done)
        if os.path.lexists(folder) and not folder.is_dir():
            raise ConfigError(f"--checkpoint-dir {str(root)!r}: {str(folder)!r} is not a "
                              f"folder, and this run writes its checkpoint of step {done} "
                              f"there; move it away (checked before training, so that no "
                              f"training is lost)")
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            what = "is a folder" if entry.is_dir() else None if OWN.fullmatch(entry.name) \
                else "is not a file FlexPipe writes"
            if what is not None:
                raise ConfigError(f"--checkpoint-dir {str(root)!r}: {str(entry)!r} {what}, "
                                  f"in the folder where this run writes its checkpoint of "
                                  f"step {done}; move it away (checked before training, so "
                                  f"that no training is lost)")


def clear_leftover(folder: Path) -> None:
    """Remove what an interrupted or damaged checkpoint left in ``folder`` (only FlexPipe's
    files, and no DCP manifest: a complete DCP folder is replaced whole when the new one is
    renamed into place), so that the checkpoint of its step can be written there."""
    if not folder.is_dir() or (folder / "flexpipe-manifest.json").is_file():
        return
    entries = list(folder.iterdir())
    if all(e.is_file() and not e.is_symlink() and OWN.fullmatch(e.name) for e in entries):
        shutil.rmtree(folder)


def free_space(root: Path) -> int:
    """Bytes free on the file system ``root`` is (or will be made) on."""
    here = root.absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return shutil.disk_usage(here).free


def room(root: Path, need: int, free: int, step: int) -> str | None:
    """Why the checkpoint of ``step`` (``need`` bytes) cannot be written with ``free`` bytes
    free (None: it fits)."""
    if free >= need:
        return None
    return f"checkpoint of step {step} not written: {str(root)!r} has {_size(free)} free, " \
        f"it needs about {_size(need)}; nothing of it was written and the checkpoints " \
        f"already complete are kept (free some space and run again to resume)"


def prepare(root: str | Path, plan: Plan, say: Callable[[str], None]) -> DirLock:
    """Every check before training (see the module docstring); the held lock."""
    folder = Path(root)
    _make(folder)
    held = lock(folder, say)
    try:
        removed = clean_temporaries(folder)
        if removed:
            say(f"removed {len(removed)} temporary file(s) left by an interrupted run "
                f"(e.g. {removed[0]})")
        in_the_way(folder, plan)
        check_space(folder, plan, say)
    except BaseException:
        held.release()
        raise
    return held


def write_error(path: Path, exc: BaseException) -> RunError:
    """A ``RunError`` for a checkpoint file that could not be written: the file, the reason
    (no space left, read-only, ...) and the free space left."""
    reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0][:120]
    if getattr(exc, "errno", None) == errno.ENOSPC:
        reason = "no space left on device (ENOSPC)"
    try:
        free = f"; {_size(shutil.disk_usage(path.parent).free)} free there"
    except OSError:
        free = ""
    return RunError(f"checkpoint: cannot write {path}: {reason}{free}; the checkpoints "
                    f"already complete are kept")
