"""Checkpoints in the per-stage format older FlexPipe versions wrote (``stage-N.pt`` files by
``torch.save`` and ``manifest.json`` format 2), made here as that writer made them, to test
that a run still resumes from one (once) and refuses a damaged or forged one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flexpipe.runtime.processes.ckdir import MANIFEST, stage_file, step_dir
from flexpipe.runtime.processes.manifests import FORMAT
from flexpipe.runtime.processes.rngstate import rng_state
from flexpipe.runtime.processes.saved import sha256


def save_stages(root: str | Path, step: int, stages: Mapping[int, Any],
                opt: torch.optim.Optimizer) -> None:
    """The stage files of ``stages`` at ``step``."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    for s, stage in stages.items():
        named = stage.named_global_parameters()
        optim = {n: {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                     for k, v in opt.state[p].items()}
                 for n, p in named.items() if opt.state.get(p)}
        payload = {"format": FORMAT, "stage": s, "step": step, "rng": rng_state(),
                   "params": {n: p.detach().clone() for n, p in named.items()}, "optim": optim}
        torch.save(payload, folder / stage_file(s))


def write_manifest(root: str | Path, step: int, num_stages: int,
                   meta: Mapping[str, Any]) -> Path:
    """The manifest of the stage files at ``step`` (written: the checkpoint is complete)."""
    folder = step_dir(root, step)
    files = {str(s): stage_file(s) for s in range(num_stages)}
    body = {"format": FORMAT, "step": step, "files": files,
            "meta": {"stages": num_stages, **meta},
            "sizes": {n: (folder / n).stat().st_size for n in files.values()},
            "sha256": {n: sha256(folder / n) for n in files.values()}}
    (folder / MANIFEST).write_text(json.dumps(body, indent=1))
    return folder
