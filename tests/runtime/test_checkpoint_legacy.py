"""The per-stage checkpoints of older FlexPipe versions (``old_format``): a run resumes from one
once, saying so, into any cut of the same model, and writes DCP from then on; a damaged one is
skipped naming the file and the reason; a forged one (its manifest made to match) is refused at
load: a pickle payload by ``weights_only`` (nothing runs), a stage file of another step, a NaN
or an infinity naming the tensor."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import old_format
import pytest
import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import build_stages
from flexpipe.runtime.models.kinds import build_model
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes.ckdir import MANIFEST
from flexpipe.runtime.processes.train import TrainConfig, make_optimizer

TINY = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=16, seq=4, micro_batch=1)
META = ck.describe(TINY, "adamw")
LAYOUT = {"pp": 2, "dp": 1, "tp": 1, "stages": 2}
NEWEST = "step-00000004"


def _model(optimizer: str = "adamw") -> tuple[dict, torch.optim.Optimizer]:  # type: ignore[type-arg]
    layers, _ = build_model(TINY)
    stages = build_stages(layers, None, 2)
    opt = make_optimizer([p for s in stages.values() for p in s.parameters()],
                         TrainConfig(optimizer=optimizer))
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    return stages, opt


def _two_checkpoints(folder: Path) -> tuple[dict, torch.optim.Optimizer]:  # type: ignore[type-arg]
    stages, opt = _model()
    for step in (2, 4):
        old_format.save_stages(folder, step, stages, opt)
        old_format.write_manifest(folder, step, 2, META)
    return stages, opt


class _Payload:
    """A pickle that would run a command when unpickled without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0xFF for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def _rewrite_manifest(folder: Path, **changes: object) -> None:
    path = folder / MANIFEST
    body = json.loads(path.read_text())
    body.update(changes)
    path.write_text(json.dumps(body))


ATTACKS = {
    "flip 4 bytes": (lambda d: _flip(d / NEWEST / "stage-0.pt"), "stage-0.pt does not match "
                     "its SHA-256"),
    "truncate": (lambda d: (d / NEWEST / "stage-1.pt").write_bytes(
        (d / NEWEST / "stage-1.pt").read_bytes()[:-7]), "stage-1.pt has"),
    "delete a stage file": (lambda d: (d / NEWEST / "stage-1.pt").unlink(),
                            "stage-1.pt is missing"),
    "delete the manifest": (lambda d: (d / NEWEST / MANIFEST).unlink(), "no manifest.json"),
    "manifest claims step 999": (lambda d: _rewrite_manifest(d / NEWEST, step=999),
                                 "says step 999, its folder is step-00000004"),
    "manifest names another file": (lambda d: _rewrite_manifest(
        d / NEWEST, files={"0": "../../x.pt", "1": "stage-1.pt"}), "not the stage files"),
    "manifest without checksums": (lambda d: _rewrite_manifest(d / NEWEST, sha256=None),
                                   "no sizes or sha256"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_damaged_checkpoint_is_skipped_naming_file_and_reason(tmp_path: Path,
                                                              attack: str) -> None:
    _two_checkpoints(tmp_path)
    damage, reason = ATTACKS[attack]
    damage(tmp_path)
    found, skipped = ck.find(tmp_path)
    assert found is not None and found.step == 2 and found.kind == "stages", attack
    assert len(skipped) == 1 and NEWEST in skipped[0] and reason in skipped[0], skipped


def test_consistent_fake_checkpoint_is_refused_at_load(tmp_path: Path) -> None:
    stages, opt = _two_checkpoints(tmp_path)
    folder = tmp_path / NEWEST
    marker = tmp_path / "pwned"
    (folder / "stage-0.pt").write_bytes(pickle.dumps(_Payload(marker)))
    old_format.write_manifest(tmp_path, 4, 2, META)  # a manifest that matches the fake
    manifest = ck.latest(tmp_path)
    assert manifest is not None and manifest.step == 4
    with pytest.raises(ConfigError, match=r"stage-0.pt refused: not a plain-data stage file"):
        ck.load(manifest, stages, opt, LAYOUT)
    assert not marker.exists()
    shutil.copy(tmp_path / "step-00000002" / "stage-0.pt", folder / "stage-0.pt")
    old_format.write_manifest(tmp_path, 4, 2, META)
    with pytest.raises(ConfigError, match=r"holds stage 0 at step 2 .* says stage 0 at step 4"):
        ck.load(ck.latest(tmp_path), stages, opt, LAYOUT)  # type: ignore[arg-type]


@pytest.mark.parametrize(("optimizer", "key", "value"), [
    ("adamw", "exp_avg_sq", float("inf")), ("adamw", "exp_avg", float("nan")),
    ("sgd", "momentum_buffer", float("-inf")), ("sgd", None, float("nan"))])
def test_a_nonfinite_checkpoint_is_refused_naming_the_tensor(
        tmp_path: Path, optimizer: str, key: str | None, value: float) -> None:
    stages, opt = _model(optimizer)
    old_format.save_stages(tmp_path, 2, stages, opt)
    path = tmp_path / "step-00000002" / "stage-1.pt"
    data = torch.load(path, weights_only=True)
    name = sorted(data["optim"])[-1]
    tensor = data["optim"][name][key] if key else data["params"][name]
    tensor.view(-1)[-1] = value
    torch.save(data, path)  # by hand: the manifest made to match, as an older writer would
    old_format.write_manifest(tmp_path, 2, 2, ck.describe(TINY, optimizer))
    manifest = ck.latest(tmp_path)
    assert manifest is not None
    what = f"optimizer state {key} of {name}" if key else f"parameter {name}"
    with pytest.raises(ConfigError, match=f"stage-1.pt refused: {what} holds non-finite"):
        ck.load(manifest, stages, opt, LAYOUT)


def test_resumed_once_into_another_cut_then_dcp(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    stages, opt = _two_checkpoints(tmp_path)
    fresh = build_stages(build_model(TINY)[0], [1, 3], 2)  # another cut of the same layers
    fresh_opt = make_optimizer([p for s in fresh.values() for p in s.parameters()],
                               TrainConfig(optimizer="adamw"))
    resumer = ck.Checkpointer(tmp_path, 1, 6, 0, META, 30.0, LAYOUT, batch=3)
    assert resumer.resume(fresh, fresh_opt) == (4, 12)  # the old data position: the step
    err = capsys.readouterr().err
    assert "per-stage format of an older FlexPipe: resumed from it this once" in err, err
    got, want = ck.named(fresh), ck.named(stages)
    for name, p in want.items():
        assert torch.equal(got[name], p), name
        for k, v in opt.state[p].items():
            assert torch.equal(fresh_opt.state[got[name]][k], v), (name, k)
    resumer.after(4, fresh, fresh_opt, 15)  # the checkpoint after step 5: DCP
    found = ck.latest(tmp_path)
    assert found is not None and (found.step, found.kind) == (5, "dcp")
    assert found.body["samples"] == 15
    assert [m.kind for m in ck.complete(tmp_path)] == ["stages", "dcp"]  # KEEP = 2
