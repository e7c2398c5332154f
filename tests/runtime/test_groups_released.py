"""A process that builds pipeline after pipeline, or trains job after job, holds the process
groups of the one it runs, not of every one before (the shared 2-process launch): each gloo
group keeps threads and connections of its own until it is destroyed, and a launch that kept
them all ran hundreds of busy threads per rank.

- ``Pipeline.close`` ends the groups its pipeline made (``groups.drop_groups``); a closed
  pipeline refuses a later step, saying so; the device mesh of a layout is made once per
  process group (``groups.device_mesh``), so three pipelines in turn hold as many groups as
  one;
- ``run_job`` ends its job's groups with the job (``groups.own_groups``): three jobs in turn
  leave the process as they found it;
- a step after a closed pipeline's successor still trains (the groups left are sound)."""

from __future__ import annotations

from typing import Any

import pytest
import shared_launch
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import RunError
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.train import Job, TrainConfig, run_job
from flexpipe.schedules import registry

TINY = ModelSpec("gpt", layers=2, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)


def _held() -> int:
    """How many process groups this process holds (the default one too)."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _pipe(dp: int) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    return flexpipe.pipeline(model, "1f1b", loss_fn=fn.mse_loss, m=2, dp=dp,
                             example=torch.randn(2, 4))


def _step(pipe: Any) -> float | None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    loss = pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    return None if loss is None else float(loss)


def groups_main() -> dict[str, Any]:
    """The groups held before and after each of three pipelines (built, stepped, closed) and
    three jobs, what a closed pipeline says to a step, and a later pipeline's loss."""
    from flexpipe.runtime.transport import groups

    out: dict[str, Any] = {"start": _held(), "pipes": [], "jobs": []}
    for dp in (1, 1, 1):
        pipe = _pipe(dp)
        _step(pipe)
        pipe.close()
        out["pipes"].append((_held(), len(groups.made_groups())))
    try:
        _step(pipe)
    except RunError as exc:
        out["closed"] = str(exc)
    job = Job(registry.build("1f1b", 2, 2), TINY, TrainConfig(steps=1))
    for _ in range(3):
        run_job(job, *_rank_world())
        out["jobs"].append((_held(), len(groups.made_groups())))
    out["after"] = _step(_pipe(1))
    return out


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


shared_launch.register(2, "groups-released", lambda: (groups_main, ()))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return shared_launch.results(2, "groups-released")


def test_pipelines_in_turn_hold_the_groups_of_one(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        held = [h for h, _ in out["pipes"]]
        assert held[0] == held[1] == held[2], held  # the mesh once, nothing else left
        assert all(made == 0 for _, made in out["pipes"])


def test_jobs_in_turn_leave_the_groups_as_they_found_them(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        held = [h for h, _ in out["jobs"]]
        assert held[0] == held[1] == held[2], held
        assert all(made == 0 for _, made in out["jobs"])


def test_a_closed_pipeline_refuses_a_step_and_a_new_one_trains(
        ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert "was closed" in out["closed"] and "flexpipe.pipeline" in out["closed"]
    losses = [out["after"] for out in ranks if out["after"] is not None]
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses[0]))

