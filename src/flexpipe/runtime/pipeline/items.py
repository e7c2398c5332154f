"""A loss that averages over counted items (Hugging Face's token mean, which skips labels of
-100): each micro-batch's mean loss weighted by its share of the batch's items, so the
gradient is one device's on the whole batch (``Pipeline(loss_items=...)``). The items are
counted from the targets (your ``loss_fn``) or, for a model computing its own loss, from its
``labels`` input on the first stage, and shared with the loss's rank. Without it every
micro-batch weighs 1 / m, which equals one device only where the micro-batches count the
same number of items."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flexpipe.errors import ConfigError
from flexpipe.runtime.transport import comm

ItemCount = Callable[[Any], "int | float | torch.Tensor"]
"""``loss_items(target)``: how many items a micro-batch's mean loss averages over (e.g.
``(target != -100).sum()``)."""


def counts(loss_items: ItemCount, targets: Sequence[Any]) -> list[float]:
    """Each micro-batch's item count, checked: a finite number >= 0."""
    out = []
    for j, target in enumerate(targets):
        got = loss_items(target)
        value = float(got) if isinstance(got, int | float) or (
            isinstance(got, torch.Tensor) and got.numel() == 1) else None
        if value is None or not math.isfinite(value) or value < 0:
            raise ConfigError(f"loss_items(target of micro-batch {j}) returned {got!r}: "
                              "expected the number of items its loss averages over (>= 0)")
        out.append(value)
    return out


def shared(mine: Sequence[float], m: int, group: object, device: torch.device) -> list[float]:
    """The item counts of the ranks that read the data (``mine``; [] elsewhere), on every
    pipeline rank of ``group`` (every one calls this together): the loss's rank learns them
    from the first stage's when the model computes its own loss from its ``labels``."""
    counts = torch.tensor(list(mine) or [0.0] * m, dtype=torch.float64, device=device)
    if group is not None:  # None: one pipeline rank, which reads everything
        comm.all_reduce_max(counts, group)  # the readers' counts are equal: others give 0
    return [float(c) for c in counts.cpu()]


def weights(mine: Sequence[float], dp: int, group: object, device: torch.device
            ) -> tuple[list[float], float]:
    """Each micro-batch's loss weight, its count over the count of every replica's batch
    (times ``dp``: the replicas' gradients are averaged after), and the share of the items
    this replica holds (every rank calls this together with its pipeline rank's replicas)."""
    total = torch.tensor([sum(mine)], dtype=torch.float64, device=device)
    if dp > 1:
        comm.all_reduce_sum([total], group)
    every = float(total)
    if every == 0:
        return [0.0] * len(mine), 0.0
    return [c * dp / every for c in mine], sum(mine) / every


def replica_mean(loss: float, dp: int, share: float) -> float:
    """This replica's mean over its own items, from the sum of its micro-batches' weighted
    losses (``weights``' weights, ``share`` its share of the items). A replica whose batch
    counts no item (every micro-batch's ``loss_items`` 0) has loss 0, as each of its
    micro-batches has, and adds no gradient."""
    return loss / (dp * share) if share else 0.0
