"""Comparing a pipelined run with a reference: the per-rank tensors (gradients or parameters by
global name) joined into one dictionary, and the largest relative difference between two such
dictionaries. Used by the equivalence tests and benchmarks."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from flexpipe.errors import ConfigError


def by_name(ranks: Iterable[object], attr: str = "grads") -> dict[str, torch.Tensor]:
    """``attr`` ("grads" or "params") of every rank of replica 0, joined by global name (each
    name lives on one pipeline rank). Ranks without a ``replica`` count as replica 0."""
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        if getattr(r, "replica", 0) == 0:
            out.update(getattr(r, attr))
    return out


def worst_relative_error(got: Mapping[str, torch.Tensor],
                         want: Mapping[str, torch.Tensor]) -> tuple[str, float]:
    """The name whose tensor differs most from ``want``'s, relative to ``want``'s norm (floored
    at 1e-12), and that difference; ``ConfigError`` when the names differ or there are none."""
    if sorted(got) != sorted(want) or not want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ConfigError(f"parameter names differ: missing {missing[:4]}, extra {extra[:4]}"
                          if want else "nothing to compare: the reference has no tensors")
    errs = {name: (got[name] - ref).norm().item() / max(ref.norm().item(), 1e-12)
            for name, ref in want.items()}
    name = max(errs, key=errs.__getitem__)
    return name, errs[name]
