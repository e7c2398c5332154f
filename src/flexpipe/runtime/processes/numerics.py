"""Non-finite numbers in training: found on the step they appear, named, and never stepped
into the weights or a checkpoint.

After a step's forward and backward passes (before the data-parallel average and the optimizer
step), every rank looks at its own loss and gradients (``local_problem``: one fused norm per
rank, the parameter named only when one is bad), then all ranks agree (``agree``: one
all-reduce of a flag over the whole world; only when it is raised, an all-gather of the
descriptions), so that every rank takes the same decision on the same step. The policy
(``POLICIES``) decides what follows: ``stop`` (the default) raises ``NonFiniteError`` on every
rank, naming the step, the rank, the stage and the loss or the parameter, before the optimizer
step and before any checkpoint; ``skip`` drops the step's update (gradients zeroed, the
optimizer not stepped) and goes on. ``first_nonfinite`` is also the checkpoint writer's last
check: a tensor with a NaN or an infinity is never written.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping

import torch

from flexpipe.errors import ConfigError, RunError
from flexpipe.runtime.transport.engines import local


class NonFiniteError(RunError):
    """A loss or a gradient (or a value about to be checkpointed) is NaN or infinite. ``peer``
    is the rank where it appeared when that is another rank (the launcher then blames that
    rank, not every rank that stopped with it)."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        if peer is not None:
            self.peer = peer


def first_nonfinite(named: Mapping[str, torch.Tensor | None]) -> str | None:
    """The name of the first floating-point tensor of ``named`` holding a NaN or an infinity
    (None: every one is finite). One fused reduction; names are searched only on failure."""
    tensors = [(n, local(t)) for n, t in named.items()
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
    if not tensors:
        return None
    norms = torch._foreach_norm([t.detach().float() for _, t in tensors], float("inf"))
    if bool(torch.isfinite(torch.stack([n.cpu() for n in norms])).all()):
        return None
    return next((n for n, t in tensors if not bool(torch.isfinite(t.detach()).all())), None)


def check_finite(named: Mapping[str, torch.Tensor | None], what: str) -> None:
    """A ``NonFiniteError`` saying ``what`` and naming the first tensor of ``named`` that holds
    a NaN or an infinity."""
    bad = first_nonfinite(named)
    if bad is not None:
        value = named[bad]
        assert value is not None
        raise NonFiniteError(f"{what}: {bad} holds {_what(value)}")


def _what(value: torch.Tensor) -> str:
    """``nan`` or ``inf`` (which non-finite values a tensor holds)."""
    kinds = [k for k, found in (("nan", torch.isnan(value).any()),
                                ("inf", torch.isinf(value).any())) if bool(found)]
    return " and ".join(kinds) or "non-finite values"


def local_problem(step: int, rank: int, stages: Mapping[int, torch.nn.Module],
                  loss: float | None, loss_stage: int | None = None) -> str | None:
    """What is not finite on this rank after ``step`` (counted from 0)'s backward passes: the
    loss, else the first gradient (by global parameter name when the stage has one), in one
    line naming the step, the rank and the stage; None when all is finite."""
    where = f"step {step + 1}, rank {rank}"
    if loss is not None and not math.isfinite(loss):
        stage = f", stage {loss_stage}" if loss_stage is not None else ""
        return f"{where}{stage}: the loss is {loss}"
    for s in sorted(stages):
        grads = {n: p.grad for n, p in _named(stages[s]).items()}
        bad = first_nonfinite(grads)
        if bad is not None:
            grad = grads[bad]
            assert grad is not None
            return f"{where}, stage {s}: the gradient of parameter {bad} holds {_what(grad)}"
    return None


def _named(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A stage's parameters by global name when it has them, else by local name."""
    named = getattr(stage, "named_global_parameters", None)
    return dict(named()) if callable(named) else dict(stage.named_parameters())


def agree(problem: str | None, device: torch.device | None = None) -> list[tuple[int, str]]:
    """Every rank's problem (rank, description), the same list on every rank, in rank order;
    empty when no rank has one. Collective: every rank of the world calls it on each step."""
    from flexpipe.runtime.transport import comm

    flag = torch.tensor([1.0 if problem is not None else 0.0], device=device)
    comm.all_reduce_mean([flag], None, comm.world_size())
    if float(flag) == 0.0:
        return []
    every = comm.all_gather_object(problem)
    return [(r, text) for r, text in enumerate(every) if text is not None]


def _stop(found: list[tuple[int, str]], rank: int) -> bool:
    origin = found[0][0]
    text = "; ".join(t for _, t in found[:3])
    more = f" (and {len(found) - 3} more ranks)" if len(found) > 3 else ""
    raise NonFiniteError(f"non-finite numbers at {text}{more}; the run stops before the "
                         f"optimizer step, no checkpoint of it is written (--on-nan skip "
                         f"drops such steps instead; a lower --lr often helps)",
                         None if origin == rank else origin)


def _skip(found: list[tuple[int, str]], rank: int) -> bool:
    if rank == 0:
        print(f"flexpipe: non-finite numbers at {found[0][1]}: that step's update is skipped "
              f"(--on-nan skip)", file=sys.stderr, flush=True)
    return False


POLICIES: dict[str, Callable[[list[tuple[int, str]], int], bool]] = {"stop": _stop,
                                                                     "skip": _skip}
"""What to do when a rank's loss or gradients are not finite: raise on every rank, or drop the
step's update (returns whether to apply the update)."""


def check_policy(policy: str) -> str:
    """``policy`` if it is a known policy; else a ``ConfigError`` listing them."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown non-finite policy {policy!r} (choose from "
                          f"{', '.join(POLICIES)})")
    return policy


def guard_step(step: int, rank: int, stages: Mapping[int, torch.nn.Module], loss: float | None,
               policy: str = "stop", device: torch.device | None = None,
               loss_stage: int | None = None) -> bool:
    """Whether to apply ``step``'s update: True when every rank's loss and gradients are
    finite; else what ``policy`` says (``stop`` raises ``NonFiniteError`` on every rank;
    ``skip`` zeroes this rank's gradients and returns False). Collective."""
    found = agree(local_problem(step, rank, stages, loss, loss_stage), device)
    if not found:
        return True
    if not POLICIES[check_policy(policy)](found, rank):
        for stage in stages.values():
            for p in stage.parameters():
                if p.grad is not None:
                    p.grad.zero_()
        return False
    return True
