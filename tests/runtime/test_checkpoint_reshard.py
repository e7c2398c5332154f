"""A checkpoint of ``flexpipe run`` resumes at another (pp, dp, tp): trained 2 steps on the
shipped text sample at pp 2, dp 1 (1F1B, AdamW, float64), it loads at pp 1 x dp 2, at tp 2 and
under FSDP2 (ZeroPP, 2 stages on one rank, sharded over dp 2) with the very parameters it
saved, bit for bit; resumed at pp 1 x dp 2 for 2 more steps, its losses and parameters equal
those of an uninterrupted pp 1 x dp 2 run to rtol 1e-12 (what "bit-exact after resume at
another layout" means: the state and the data position carry over exactly; the steps before
the checkpoint ran at another dp, whose gradient reduction adds in another order, so the
uninterrupted run differs from the first two steps on in the last bits)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from flexpipe.runtime.data.corpus import DataConfig
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes import checkpoint as ck
from flexpipe.runtime.processes.launch import launch
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.schedules import registry

TEXT = Path(__file__).parents[2] / "examples" / "data" / "tiny_text.txt"
GPT = ModelSpec("gpt", layers=2, hidden=8, heads=2, vocab=256, seq=8, micro_batch=1,
                dtype="float64")
RTOL = 1e-12


def _job(name: str, pp: int, m: int, steps: int, folder: Path | None, dp: int = 1,
         tp: int = 1) -> Job:
    train = TrainConfig(steps=steps, optimizer="adamw", lr=0.01, dp=dp, tp=tp, timeout_s=60,
                        capture=True, data=DataConfig(str(TEXT)), checkpoint_every=2,
                        checkpoint_dir=None if folder is None else str(folder))
    schedule = registry.build(name, pp, m, **({"v": 2} if name == "zeropp" else {}))
    return Job(schedule, GPT, train)


def _params(ranks: list[Any]) -> dict[str, torch.Tensor]:
    return {k: v for r in ranks for k, v in r.params.items()}


def _losses(ranks: list[Any]) -> list[float]:
    sinks = [r.losses for r in ranks if r.losses and r.losses[0] is not None]
    return sinks[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any], list[Any]]:
    """The checkpoint written after 2 steps at pp 2 (its folder, its ranks' results) and an
    uninterrupted 4-step run at pp 1 x dp 2."""
    first = tmp_path_factory.mktemp("reshard") / "pp2"
    written, whole = launch([_job("1f1b", 2, 4, 2, first),  # global batch 4 either way
                             _job("1f1b", 1, 2, 4, None, dp=2)], 2, timeout_s=60)
    found = ck.latest(first)
    assert found is not None and found.step == 2 and found.body["samples"] == 8
    assert found.body["layout"] == {"pp": 2, "dp": 1, "tp": 1, "stages": 2}
    return first, written, whole


def _copies(first: Path, tmp_path: Path, names: tuple[str, ...]) -> list[Path]:
    out = []
    for name in names:
        shutil.copytree(first, tmp_path / name)
        out.append(tmp_path / name)
    return out


def _same_state(loaded: list[Any], written: list[Any]) -> None:
    """The parameters a resume loaded equal those the checkpoint saved, to the bit."""
    saved, got = _params(written), _params(loaded)
    assert got.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(got[name], value), name


def test_a_checkpoint_resumes_at_another_dp_and_pp(
        trained: tuple[Path, list[Any], list[Any]], tmp_path: Path) -> None:
    first, written, whole = trained
    on, check = _copies(first, tmp_path, ("dp2", "dp2-check"))
    resumed, loaded = launch([_job("1f1b", 1, 2, 4, on, dp=2),
                              _job("1f1b", 1, 2, 2, check, dp=2)],  # every step done: loads
                             2, timeout_s=60)
    _same_state(loaded, written)
    assert {r.start_step for r in resumed} == {2}
    torch.testing.assert_close(_losses(resumed), _losses(whole)[2:], rtol=RTOL, atol=0)
    ref = _params(whole)
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, ref[name], rtol=RTOL, atol=1e-14, msg=name)
    after = ck.latest(on)
    assert after is not None and after.step == 4 and after.body["samples"] == 16
    assert after.body["layout"] == {"pp": 1, "dp": 2, "tp": 1, "stages": 1}


@pytest.mark.slow
def test_a_checkpoint_loads_under_tensor_parallelism_and_fsdp(
        trained: tuple[Path, list[Any], list[Any]], tmp_path: Path) -> None:
    first, written, _ = trained
    tp, fsdp = _copies(first, tmp_path, ("tp2", "fsdp"))
    for loaded in launch([_job("1f1b", 1, 4, 2, tp, tp=2),
                          _job("zeropp", 1, 2, 2, fsdp, dp=2)], 2, timeout_s=60):
        _same_state(loaded, written)
