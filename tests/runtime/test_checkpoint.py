"""Checkpoint and resume: a run killed at a random step and resumed from its checkpoint ends
with the same parameters, bit for bit, as an uninterrupted run; it may resume onto another
schedule with the same stages; a half-written checkpoint is never picked up; files load with
``weights_only=True``."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.runtime import checkpoint as ck
from flexpipe.runtime import limits
from flexpipe.runtime.faults import inject_forward_fault
from flexpipe.runtime.launch import LaunchError, launch, launch_task
from flexpipe.runtime.models import ModelSpec, build_model
from flexpipe.runtime.stage import build_stages
from flexpipe.runtime.train import Job, TrainConfig, make_optimizer, run_job
from flexpipe.schedules import registry

TINY = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)
STEPS, M = 6, 4


def _job(name: str, folder: Path | None, capture: bool = False) -> Job:
    train = TrainConfig(steps=STEPS, optimizer="adamw", lr=0.01, timeout_s=30, capture=capture,
                        checkpoint_dir=None if folder is None else str(folder),
                        checkpoint_every=1)
    return Job(registry.build(name, 2, M), TINY, train)


def killed_task(rank: int, world: int, job: Job, victim: int, at_forward: int) -> list[object]:
    """Run ``job``; rank ``victim`` is killed (SIGKILL) as it starts its ``at_forward``-th
    forward."""
    if rank == victim:
        inject_forward_fault("kill", at_forward)
    return [run_job(job, rank, world)]


def _params(ranks: list) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    return {k: v for r in ranks for k, v in r.params.items()}


def test_killed_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    rng = random.Random()
    victim, at = rng.randrange(2), rng.randint(M + 1, M * (STEPS - 2))  # mid step 1..4
    where = f"(rank {victim} killed at its forward #{at})"
    first, second = tmp_path / "a", tmp_path / "b"
    with pytest.raises(LaunchError) as info:
        launch_task(killed_task, (_job("1f1b", first), victim, at), 2, timeout_s=30)
    assert info.value.culprit == victim, f"{where}\n{info.value}"
    found = ck.latest(first)
    assert found is not None and 1 <= found.step <= (at - 1) // M, where
    shutil.copytree(first, second)
    jobs = [_job("1f1b", first, True), _job("zb-h1", second, True),
            _job("1f1b", None, True)]
    resumed, other, whole = launch(jobs, 2, timeout_s=30)
    assert {r.start_step for r in resumed} == {found.step}, where
    assert len(resumed[0].losses) == STEPS - found.step
    mine, ref = _params(resumed), _params(whole)
    assert mine.keys() == ref.keys()
    for name in ref:
        assert torch.equal(mine[name], ref[name]), f"{name} differs {where}"
    for name, t in _params(other).items():  # another schedule, same stages
        torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-6, msg=f"{name} {where}")
    assert ck.latest(first) is not None and ck.latest(first).step == STEPS  # type: ignore[union-attr]


def _model() -> tuple[dict, torch.optim.Optimizer]:  # type: ignore[type-arg]
    layers, _ = build_model(TINY)
    stages = build_stages(layers, None, 2)
    opt = make_optimizer([p for s in stages.values() for p in s.parameters()],
                         TrainConfig(optimizer="adamw"))
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    return stages, opt


def test_half_written_checkpoint_is_ignored(tmp_path: Path) -> None:
    stages, opt = _model()
    meta = ck.describe(TINY, 2, "adamw")
    ck.save_stages(tmp_path, 2, stages, opt)
    ck.write_manifest(tmp_path, 2, 2, meta)
    ck.save_stages(tmp_path, 4, {0: stages[0]}, opt)  # killed before stage 1 and the manifest
    assert ck.latest(tmp_path).step == 2  # type: ignore[union-attr]
    ck.save_stages(tmp_path, 4, {1: stages[1]}, opt)
    ck.write_manifest(tmp_path, 4, 2, meta)
    assert ck.latest(tmp_path).step == 4  # type: ignore[union-attr]
    path = tmp_path / "step-00000004" / "stage-1.pt"
    path.write_bytes(path.read_bytes()[:100])  # torn file: size differs from the manifest
    assert ck.latest(tmp_path).step == 2  # type: ignore[union-attr]
    (tmp_path / "step-00000002" / ck.MANIFEST).write_text("{not json")
    assert ck.latest(tmp_path) is None
    assert not list(tmp_path.rglob("*.tmp*"))


def test_load_restores_exactly_and_refuses_another_model(tmp_path: Path) -> None:
    stages, opt = _model()
    meta = ck.describe(TINY, 2, "adamw")
    ck.save_stages(tmp_path, 1, stages, opt)
    ck.write_manifest(tmp_path, 1, 2, meta)
    manifest = ck.latest(tmp_path)
    assert manifest is not None
    data = torch.load(manifest.path / "stage-0.pt", weights_only=True)  # plain data only
    assert data["stage"] == 0 and data["step"] == 1
    fresh, fresh_opt = _model()
    with torch.no_grad():
        for s in fresh.values():
            for p in s.parameters():
                p.zero_()
    ck.load_stages(manifest, fresh, fresh_opt)
    for s in (0, 1):
        got, want = fresh[s].named_global_parameters(), stages[s].named_global_parameters()
        for name, p in want.items():
            assert torch.equal(got[name], p)
            for key, value in opt.state[p].items():
                assert torch.equal(fresh_opt.state[got[name]][key], value)
    with pytest.raises(ConfigError, match="hidden"):
        ck.check_meta(manifest, ck.describe(ModelSpec("gpt", layers=2, hidden=16), 2, "adamw"))
    other = build_stages(build_model(TINY)[0], [1, 3], 2)
    with pytest.raises(ConfigError, match="another partition"):
        ck.load_stages(manifest, other, fresh_opt)


CLI = ["run", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "8", "--heads", "2",
       "--seq", "4", "--vocab", "16", "--micro-batch-size", "1", "--timeout", "30", "--json"]


def test_cli_checkpoints_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(tmp_path / "ck")
    assert main([*CLI, "--steps", "2", "--checkpoint-dir", folder, "--mem", "1GiB"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["first_step"] == 0 and len(first["losses"]) == 2
    assert main([*CLI, "--steps", "3", "--checkpoint-dir", folder,
                 "--checkpoint-every", "1"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["first_step"] == 2 and len(second["losses"]) == 1
    assert ck.latest(folder).step == 3  # type: ignore[union-attr]


def test_cli_refuses_a_run_over_the_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(registry.build("1f1b", 2, 2), TINY, TrainConfig(optimizer="adamw"))
    peaks = limits.peaks(job)
    worst = max(range(2), key=lambda r: peaks[r])
    assert peaks[worst] > peaks[1 - worst]
    limit = (peaks[0] + peaks[1]) / 2
    assert main([*CLI, "--steps", "1", "--mem", str(limit)]) == 2
    err = capsys.readouterr().err
    assert f"rank {worst}: simulated peak {limits.size(peaks[worst])}" in err, err
    assert f"{limits.size(peaks[worst] - limit)} over the limit" in err, err
    assert f"rank {1 - worst}:" not in err, err
