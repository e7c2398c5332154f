"""``Pipeline.save``/``load`` lose nothing and read nothing wrong, at 2 ranks (1F1B, SGD with
momentum): a save over a checkpoint that fails after the ranks wrote their files leaves the
previous one whole (and loadable, to the bit); an unfinished save's folder is ignored by a
load and removed by the next save; a byte changed in one rank's file, a file cut short, a
manifest of a newer format, a checkpoint of another optimizer and a folder that is not a
checkpoint are each refused on every rank with one error naming the file, the rank that
wrote it or the optimizers; after every refusal the ranks go on in step (the last load and a
step equal the saved state exactly). The ranks are the shared 2-process launch's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import shared_launch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import FlexPipeError
from flexpipe.runtime.processes import saved

M = 2


def _said(call: Callable[[], Any]) -> str:
    """The FlexPipe error ``call`` raises ("accepted" when none)."""
    try:
        call()
    except FlexPipeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def _on_rank0(change: Callable[[], None]) -> None:
    """``change`` the files on rank 0 while the other waits."""
    dist.barrier()
    if dist.get_rank() == 0:
        change()
    dist.barrier()


def _state(pipe: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def _train(pipe: Any, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (4,),
                                                                                generator=gen)
    opt.zero_grad()
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    opt.step()


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def _shard(path: Path, rank: int) -> Path:
    return sorted(path.glob(f"__{rank}_*.distcp"))[0]


def safety_main(root: str) -> dict[str, Any]:
    """The cases of the module docstring on one rank; what each said."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=M, timeout_s=60)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    base, out = Path(root), {}
    path = base / "ck"
    _train(pipe, opt, 1)
    pipe.save(str(path), opt)
    kept = _state(pipe)
    _train(pipe, opt, 2)
    real = saved.own_files
    if dist.get_rank() == 1:  # rank 1 cannot hash what it wrote: the save fails
        saved.own_files = lambda folder, rank: "disk gone"  # type: ignore[assignment]
    out["failed save"] = _said(lambda: pipe.save(str(path), opt))
    saved.own_files = real  # type: ignore[assignment]
    out["staging left"] = saved.staging(path).is_dir()
    pipe.load(str(path), opt)
    out["kept exact"] = all(torch.equal(v, kept[k]) for k, v in _state(pipe).items())
    _train(pipe, opt, 3)
    pipe.save(str(path), opt)  # removes the unfinished folder first
    out["staging after"] = saved.staging(path).exists()
    good = _state(pipe)
    for name, change in (("flipped", lambda c: _flip(_shard(c, 1))),
                         ("truncated", lambda c: _cut(_shard(c, 0)))):
        copy = base / name
        pipe.save(str(copy), opt)
        _on_rank0(lambda c=copy, f=change: f(c))
        out[name] = _said(lambda c=copy: pipe.load(str(c), opt))
    newer = base / "newer"
    pipe.save(str(newer), opt)
    _on_rank0(lambda: _reformat(newer))
    out["newer"] = _said(lambda: pipe.load(str(newer), opt))
    adamw = torch.optim.AdamW(pipe.parameters())
    out["optimizer"] = _said(lambda: pipe.load(str(path), adamw))
    foreign = base / "mine"
    _on_rank0(lambda: (foreign.mkdir(), (foreign / "notes.txt").write_text("keep me")))
    out["foreign"] = _said(lambda: pipe.save(str(foreign), opt))
    out["foreign kept"] = (foreign / "notes.txt").read_text()
    pipe.load(str(path), opt)
    out["last exact"] = all(torch.equal(v, good[k]) for k, v in _state(pipe).items())
    _train(pipe, opt, 4)
    return out


def _cut(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-7])


def _reformat(folder: Path) -> None:
    body = json.loads((folder / saved.MANIFEST).read_text())
    (folder / saved.MANIFEST).write_text(json.dumps({**body, "format": saved.FORMAT + 1}))


def _part() -> shared_launch.Part:
    return safety_main, (shared_launch.folder("flexpipe-safety-"),)


shared_launch.register(2, "checkpoint-safety", _part)


@pytest.fixture(scope="module")
def said() -> list[dict[str, Any]]:
    return shared_launch.results(2, "checkpoint-safety")


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_failed_save_keeps_the_previous_checkpoint_whole(said: list[dict[str, Any]]) -> None:
    for r in said:
        assert r["failed save"].startswith("RunError: Pipeline.save to "), r
        assert "rank 1: disk gone" in r["failed save"] and "rank 0:" not in r["failed save"], r
        assert "the previous checkpoint there, if any, is kept" in r["failed save"], r
        assert r["staging left"] and r["kept exact"] and not r["staging after"], r
        assert r["last exact"], r


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_damaged_files_are_refused_naming_the_file_and_its_rank(
        said: list[dict[str, Any]]) -> None:
    assert said[0] == said[1]  # one decision on every rank
    r = said[0]
    assert "refused on every rank" in r["flipped"], r
    assert "__1_0.distcp (written by rank 1) does not match its SHA-256" in r["flipped"], r
    assert "__0_0.distcp (written by rank 0) has" in r["truncated"], r
    assert "truncated" in r["truncated"], r
    assert f"has format {saved.FORMAT + 1}" in r["newer"], r


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_another_optimizer_and_a_foreign_folder_are_refused_by_name(
        said: list[dict[str, Any]]) -> None:
    r = said[1]
    assert "state of a SGD optimizer, the one given is a AdamW" in r["optimizer"], r
    assert "is not a FlexPipe checkpoint" in r["foreign"], r
    assert r["foreign kept"] == "keep me"
