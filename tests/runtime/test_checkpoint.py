"""Checkpoint and resume (DCP): a run killed at a random step and resumed from its checkpoint
ends with the same parameters, bit for bit, as an uninterrupted run; it may resume onto another
schedule or another cut; a half-written checkpoint is never picked up; a damaged one is skipped
naming the file and the reason; a forged one runs no code. (The older per-stage format:
``test_checkpoint_legacy.py``.)"""

from __future__ import annotations

import json
import pickle
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flexpipe.cli.main import main
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import build_stages
from flexpipe.runtime.measurement import memory_check
from flexpipe.runtime.models.kinds import build_model
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes import saved
from flexpipe.runtime.processes.faults import forward_fault
from flexpipe.runtime.processes.launch import LaunchError, launch, launch_task
from flexpipe.runtime.processes.train import Job, TrainConfig, make_optimizer, run_job
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
    hooked = forward_fault("kill", at_forward) if rank == victim else None
    return [run_job(job, rank, world, handlers=hooked)]


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


META = ck.describe(TINY, "adamw")


def _save(folder: Path, step: int, stages: dict, opt: torch.optim.Optimizer) -> Path:  # type: ignore[type-arg]
    return ck.save(folder, step, stages, opt, samples=2 * step, meta=META,
                   layout={"pp": 2, "dp": 1, "tp": 1, "stages": 2})


def test_half_written_checkpoint_is_ignored(tmp_path: Path) -> None:
    stages, opt = _model()
    _save(tmp_path, 2, stages, opt)
    staging = saved.staging(ck.step_dir(tmp_path, 4))  # killed before the rename
    shutil.copytree(ck.step_dir(tmp_path, 2), staging)
    assert ck.latest(tmp_path).step == 2  # type: ignore[union-attr]
    _save(tmp_path, 4, stages, opt)  # the next save removes the unfinished folder
    assert not staging.exists() and ck.latest(tmp_path).step == 4  # type: ignore[union-attr]
    path = ck.step_dir(tmp_path, 4) / "__0_0.distcp"
    path.write_bytes(path.read_bytes()[:100])  # torn file: size differs from the manifest
    assert ck.latest(tmp_path).step == 2  # type: ignore[union-attr]
    (tmp_path / "step-00000002" / saved.MANIFEST).write_text("{not json")
    assert ck.latest(tmp_path) is None
    assert not list(tmp_path.rglob("*.tmp*"))


def test_load_restores_exactly_into_another_cut_and_refuses_another_model(
        tmp_path: Path) -> None:
    stages, opt = _model()
    _save(tmp_path, 1, stages, opt)
    manifest = ck.latest(tmp_path)
    assert manifest is not None and manifest.kind == "dcp"
    assert manifest.body["samples"] == 2 and manifest.body["layout"]["pp"] == 2
    for cut in (None, [1, 3]):  # the same stages, and another cut of the same layers
        fresh = build_stages(build_model(TINY)[0], cut, 2)
        fresh_opt = make_optimizer([p for s in fresh.values() for p in s.parameters()],
                                   TrainConfig(optimizer="adamw"))
        with torch.no_grad():
            for s in fresh.values():
                for p in s.parameters():
                    p.zero_()
        assert ck.load(manifest, fresh, fresh_opt, {"pp": 2}) == 2
        got, want = ck.named(fresh), ck.named(stages)
        assert got.keys() == want.keys()
        for name, p in want.items():
            assert torch.equal(got[name], p), name
            for key, value in opt.state[p].items():
                assert torch.equal(fresh_opt.state[got[name]][key], value), (name, key)
    with pytest.raises(ConfigError, match="hidden"):
        ck.check_meta(manifest, ck.describe(ModelSpec("gpt", layers=2, hidden=16), "adamw"))
    bigger = build_stages(build_model(replace(TINY, hidden=16))[0], None, 2)
    with pytest.raises(ConfigError, match="shape"):
        ck.load(manifest, bigger, make_optimizer(
            [p for s in bigger.values() for p in s.parameters()], TrainConfig(optimizer="adamw")),
            {"pp": 2})


CLI = ["run", "1f1b", "-p", "2", "-m", "2", "--layers", "2", "--hidden", "8", "--heads", "2",
       "--seq", "4", "--vocab", "16", "--micro-batch-size", "1", "--timeout", "30", "--json"]


def _run_and_resume(folder: str, capfd: pytest.CaptureFixture[str]) -> None:
    """2 steps from scratch with a checkpoint, then resumed to step 3 (checkpoint every step)."""
    assert main([*CLI, "--steps", "2", "--checkpoint-dir", folder, "--mem", "1GiB"]) == 0
    out, err = capfd.readouterr()
    first = json.loads(out)
    assert first["first_step"] == 0 and len(first["losses"]) == 2
    assert "starting from scratch" in err, err
    assert main([*CLI, "--steps", "3", "--checkpoint-dir", folder,
                 "--checkpoint-every", "1"]) == 0
    out, err = capfd.readouterr()
    second = json.loads(out)
    assert second["first_step"] == 2 and len(second["losses"]) == 1
    assert "resuming from" in err and "step-00000002 (step 2 of 3)" in err, err
    assert ck.latest(folder).step == 3  # type: ignore[union-attr]


def test_cli_checkpoints_and_resumes(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _run_and_resume(str(tmp_path / "ck"), capfd)


@pytest.mark.slow
def test_cli_resumes_from_an_older_checkpoint_past_a_damaged_one(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The command line past a damaged newest checkpoint (a third launch): CI checks what it
    uses, ``Checkpointer.resume``, announcing the damage and resuming from the older one, in
    ``test_resume_announces_and_refuses``, and the command's resume in
    ``test_cli_checkpoints_and_resumes``."""
    folder = str(tmp_path / "ck")
    _run_and_resume(folder, capfd)
    _flip(Path(folder) / "step-00000003" / "__0_0.distcp")  # damaged: announced, older one used
    assert main([*CLI, "--steps", "3", "--checkpoint-dir", folder]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["first_step"] == 2
    assert "step-00000003: __0_0.distcp (written by rank 0) does not match its SHA-256" in err, \
        err


def test_cli_refuses_a_run_over_the_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    job = Job(registry.build("1f1b", 2, 2), TINY, TrainConfig(optimizer="adamw"))
    peaks = memory_check.peaks(job)
    worst = max(range(2), key=lambda r: peaks[r])
    assert peaks[worst] > peaks[1 - worst]
    limit = (peaks[0] + peaks[1]) / 2
    assert main([*CLI, "--steps", "1", "--mem", f"{limit}B"]) == 2  # a size: bytes
    err = capsys.readouterr().err
    assert f"rank {worst}: simulated peak {memory_check.size(peaks[worst])}" in err, err
    assert f"{memory_check.size(peaks[worst] - limit)} over the limit" in err, err
    assert f"rank {1 - worst}:" not in err, err


# --- attacks on a checkpoint: every one refused or announced, never loaded silently -------------

class _Payload:
    """A pickle that would run a command when unpickled without restrictions."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def _two_checkpoints(folder: Path) -> tuple[dict, torch.optim.Optimizer]:  # type: ignore[type-arg]
    stages, opt = _model()
    for step in (2, 4):
        _save(folder, step, stages, opt)
    return stages, opt


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def _rewrite_manifest(folder: Path, **changes: object) -> None:
    path = folder / saved.MANIFEST
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


def _rehash(folder: Path) -> None:
    """Make the manifest match the files as they are now (a consistent fake)."""
    body = json.loads((folder / saved.MANIFEST).read_text())
    for name, entry in body["files"].items():
        entry.update(bytes=(folder / name).stat().st_size, sha256=saved.sha256(folder / name))
    (folder / saved.MANIFEST).write_text(json.dumps(body))


NEWEST = "step-00000004"
DATA = "__0_0.distcp"
ATTACKS = {
    "flip 4 bytes": (lambda d: _flip(d / NEWEST / DATA), f"{DATA} (written by rank 0) does "
                     "not match its SHA-256"),
    "truncate": (lambda d: (d / NEWEST / DATA).write_bytes(
        (d / NEWEST / DATA).read_bytes()[:-7]), f"{DATA} (written by rank 0) has"),
    "delete a data file": (lambda d: (d / NEWEST / DATA).unlink(), f"{DATA} (written by rank "
                           "0) is missing"),
    "flip DCP's index": (lambda d: _flip(d / NEWEST / ".metadata"), ".metadata (written by "
                         "rank 0) does not match its SHA-256"),
    "delete the manifest": (lambda d: (d / NEWEST / saved.MANIFEST).unlink(), "no "
                            "manifest.json"),
    "manifest claims step 999": (lambda d: _rewrite_manifest(d / NEWEST, step=999),
                                 "says step 999, its folder is step-00000004"),
    "manifest names another file": (lambda d: _rewrite_manifest(
        d / NEWEST, files={"../../x.pt": {"rank": 0, "bytes": 1, "sha256": "0"}}),
        "bad entry for '../../x.pt'"),
    "manifest without checksums": (lambda d: _rewrite_manifest(d / NEWEST, files=None),
                                   "no files table"),
    "manifest without data position": (lambda d: _rewrite_manifest(d / NEWEST, samples=None),
                                       "no meta table or data position"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_damaged_checkpoint_is_skipped_naming_file_and_reason(tmp_path: Path,
                                                              attack: str) -> None:
    _two_checkpoints(tmp_path)
    damage, reason = ATTACKS[attack]
    damage(tmp_path)
    found, skipped = ck.find(tmp_path)
    assert found is not None and found.step == 2, attack  # the older intact one
    assert len(skipped) == 1 and NEWEST in skipped[0] and reason in skipped[0], skipped


def test_consistent_fake_checkpoint_is_refused_at_load(tmp_path: Path) -> None:
    """A fake whose manifest matches its files (checksums recomputed): a pickle payload as
    DCP's index is refused before it is unpickled (nothing runs)."""
    stages, opt = _two_checkpoints(tmp_path)
    folder = tmp_path / NEWEST
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _rehash(folder)
    manifest = ck.latest(tmp_path)
    assert manifest is not None and manifest.step == 4
    with pytest.raises(ConfigError, match=r"\.metadata refers to posix.system"):
        ck.load(manifest, stages, opt, {})
    assert not marker.exists()


def test_resume_announces_and_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stages, opt = _two_checkpoints(tmp_path)
    _flip(tmp_path / NEWEST / DATA)

    def resumer(steps: int, want: dict) -> ck.Checkpointer:  # type: ignore[type-arg]
        return ck.Checkpointer(tmp_path, 1, steps, 0, want, 30.0, {"pp": 2, "dp": 1, "tp": 1,
                                                                  "stages": 2})

    assert resumer(6, META).resume(stages, opt) == (2, 4)
    err = capsys.readouterr().err
    assert f"skipped {tmp_path / NEWEST}: {DATA} (written by rank 0) does not match its " \
        "SHA-256" in err, err
    assert f"resuming from {tmp_path / 'step-00000002'} (step 2 of 6)" in err, err
    assert "resharded" not in err, err  # the layout that wrote it
    with pytest.raises(ConfigError, match="past this run's 1 steps"):
        resumer(1, META).resume(stages, opt)
    other = ck.describe(ModelSpec("gpt", layers=2, hidden=16), "adamw")
    with pytest.raises(ConfigError, match="written for model"):
        resumer(6, other).resume(stages, opt)
    shutil.rmtree(tmp_path / "step-00000002")
    assert resumer(6, META).resume(stages, opt) == (0, 0)
    assert "starting from scratch" in capsys.readouterr().err


def test_what_a_checkpoint_must_match_reads_back_the_same() -> None:
    """The model's automatic cut is written as JSON reads it back (a list), so the run that
    wrote a checkpoint can resume it; without a cut the model reads as before the cut
    existed."""
    for spec in (ModelSpec(), ModelSpec("user", factory="m:f", cut=("h.1", "h.2.ln_2"))):
        meta = ck.describe(spec, "adamw")
        assert json.loads(json.dumps(meta)) == meta
    assert "cut" not in ck.describe(ModelSpec(), "adamw")["model"]
