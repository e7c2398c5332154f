"""One launch per world size for the runtime tests of every file: starting a rank costs seconds
(torch, the runtime and a model library imported anew in every process) where most cases train
for a fraction of one, so the cases of every test file that trains at a given world size run in
turn in one process group, as ``launch([job1, job2, ...], world)`` runs several jobs.

A test module registers its part when it is imported (collection): ``register(world, key,
make)``, where ``make()`` gives, in this process when the launch starts, the function to call on
every rank and its arguments (``jobs(...)`` for a list of ``Job``s). The first test that asks
for a part's results (``results(world, key)``) launches every part registered for that world,
in registration order; the others read what it returned. A part that fails fails the launch:
every test reading that world's results then raises the launch's error, which names the rank
and shows its traceback (so the part)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import flexpipe
from flexpipe.cost.model import CostModel
from flexpipe.ir import Placement
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import check_job, run_jobs
from flexpipe.runtime.processes.train import Job

Part = tuple[Callable[..., Any], tuple[Any, ...]]
TIMEOUT_S = 1800
"""pytest-timeout of a test that may start a shared launch (it runs the parts of every file)."""

PEER_TIMEOUT_S = 600.0
"""Longest wait of a rank for the others where a part ends."""
_MAKERS: dict[int, dict[str, Callable[[], Part]]] = {}
_RESULTS: dict[int, dict[str, list[Any]]] = {}
_FAILED: dict[int, BaseException] = {}
GROUPED: set[str] = set()
"""The node ids of the tests that may start a launch under pytest-xdist (tests/conftest.py puts
them on one worker, so each world launches once)."""
SECONDS: dict[str, float] = {}
"""Wall seconds of each part on rank 0, by ``"<world>:<key>"`` (the suite's summary lists them)."""


def register(world: int, key: str, make: Callable[[], Part]) -> None:
    """Run ``fn(*args)`` (``make()``'s) on every rank of the ``world``-process launch."""
    parts = _MAKERS.setdefault(world, {})
    if key in parts:
        raise ValueError(f"part {key!r} of the {world}-process launch is registered twice")
    parts[key] = make


def folder(prefix: str) -> str:
    """A new folder for a part's files (its ranks get its path as an argument), removed when
    this test process ends."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def jobs(items: Iterable[Job], world: int) -> Part:
    """The part that trains ``items`` in turn, as ``launch`` does (each checked first)."""
    checked = tuple(items)
    for job in checked:
        check_job(job, world)
    return _run_jobs, (checked,)


def _run_jobs(items: tuple[Job, ...]) -> list[Any]:
    import torch.distributed as dist

    return run_jobs(dist.get_rank(), dist.get_world_size(), items)


def profiles(items: Iterable[tuple[ModelSpec, Placement]], reps: int = 1) -> Part:
    """The part that profiles each model over its placement's ranks (all of the launch's), as
    ``flexpipe.runtime.measurement.profile.profile_together`` does in a launch of its own."""
    return _profile_all, (tuple(items), reps)


def _profile_all(items: tuple[tuple[ModelSpec, Placement], ...], reps: int) -> list[Any]:
    import torch.distributed as dist

    from flexpipe.runtime.measurement.profile import profile_task

    rank, world = dist.get_rank(), dist.get_world_size()
    return profile_task(rank, world, [(model, placement, None) for model, placement in items],
                        reps)


def cost_models(world: int, key: str, placements: Iterable[Placement]) -> list[CostModel]:
    """The measured cost models of a ``profiles`` part, one per item (its placement given)."""
    from flexpipe.runtime.measurement.profile import to_cost_model

    per_rank = results(world, key)
    return [to_cost_model([r[i] for r in per_rank], placement.num_stages)
            for i, placement in enumerate(placements)]


def _run_parts(parts: list[tuple[str, Callable[..., Any], tuple[Any, ...]]]
               ) -> dict[str, tuple[Any, float]]:
    """On one rank: every part in turn; its result and wall seconds by key. The process
    groups a part makes (its pipelines' own) end with it (``groups.own_groups``)."""
    from flexpipe.runtime.transport import groups

    out: dict[str, tuple[Any, float]] = {}
    for key, fn, args in parts:
        start = time.perf_counter()
        with groups.own_groups(PEER_TIMEOUT_S):
            out[key] = (fn(*args), time.perf_counter() - start)
    return out


def _check_worker() -> None:
    """Under pytest-xdist, refuse a launch from a test outside the shared group: another worker
    would start the same launch again."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0].split("@", 1)[0]
    if os.environ.get("PYTEST_XDIST_WORKER") and test not in GROUPED:
        raise RuntimeError(f"{test} reads a shared launch but is not in the shared group "
                           "(import shared_launch in its module: tests/conftest.py groups those)")


def results(world: int, key: str) -> list[Any]:
    """Every rank's result of part ``key`` (rank order); the first call launches the world."""
    if world in _FAILED:
        raise _FAILED[world]
    if world not in _RESULTS:
        _check_worker()
        parts = [(k, *make()) for k, make in _MAKERS[world].items()]
        try:
            per_rank = flexpipe.spawn(_run_parts, world, parts, timeout_s=300,
                                      deadline_s=TIMEOUT_S - 60)
        except BaseException as exc:
            _FAILED[world] = exc
            raise
        _RESULTS[world] = {k: [r[k][0] for r in per_rank] for k, _, _ in parts}
        SECONDS.update({f"{world}:{k}": per_rank[0][k][1] for k, _, _ in parts})
    return _RESULTS[world][key]


def job_results(world: int, key: str) -> list[list[Any]]:
    """The results of a ``jobs`` part as ``launch`` returns them: per job, every rank's."""
    per_rank = results(world, key)
    return [[per_rank[r][j] for r in range(world)] for j in range(len(per_rank[0]))]
