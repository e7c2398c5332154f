"""Per-operation selective recompute, as torch's ``create_selective_checkpoint_contexts`` and
torchtitan's op-level SAC do it: inside a region SR drops (``selective.Core``), a policy
``fn(ctx, op, *args, **kwargs) -> CheckpointPolicy`` says which operations' outputs are kept
(``MUST_SAVE`` / ``PREFER_SAVE``, or ``True``) and which are recomputed (the rest). The
forward stores the kept outputs (``Saving``); SR's recompute takes them back in order instead
of computing those operations again (``Replaying``), so an expensive product (``aten.mm``) is
neither recomputed nor dropped, while everything else of the region is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from flexpipe.errors import ConfigError, RunError

OpPolicy = Callable[..., object]
"""``fn(ctx, op, *args, **kwargs)`` -> a ``CheckpointPolicy`` (or a bool: True saves)."""
SAVED = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def saving_ops(ops: Iterable[object]) -> OpPolicy:
    """The policy that keeps the outputs of ``ops`` (``torch.ops.aten.mm.default``, or a
    packet such as ``torch.ops.aten.mm``: all its overloads) and recomputes the rest."""
    wanted = frozenset(ops)

    def policy(ctx: SelectiveCheckpointContext, op: Any, *args: object,
               **kwargs: object) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", None)
        return (CheckpointPolicy.MUST_SAVE if op in wanted or packet in wanted
                else CheckpointPolicy.PREFER_RECOMPUTE)
    return policy


def check_ops(ops: Iterable[object]) -> None:
    """A ``ConfigError`` naming the first of ``ops`` that is not a torch operator."""
    kinds = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)  # noqa: SLF001 - torch's own
    bad = [op for op in ops if not isinstance(op, kinds)]
    if bad:
        raise ConfigError(f"Recompute(save_ops=...): {bad[0]!r} is not a torch operator (give "
                          "e.g. torch.ops.aten.mm.default or torch.ops.aten.mm)")


def _saves(policy: OpPolicy, recompute: bool, func: Any, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> bool:
    got = policy(SelectiveCheckpointContext(is_recompute=recompute), func, *args, **kwargs)
    if isinstance(got, bool):
        return got
    if not isinstance(got, CheckpointPolicy):
        raise ConfigError(f"Recompute(policy=...) returned {got!r} for {func}: expected a "
                          "torch.utils.checkpoint.CheckpointPolicy (or a bool)")
    return got in SAVED


def _detached(x: object) -> object:
    return x.detach() if isinstance(x, torch.Tensor) else x


class Saving(TorchDispatchMode):
    """A region's forward: the outputs of the operations ``policy`` saves, in order."""

    def __init__(self, policy: OpPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.store: list[tuple[Any, object]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _saves(self.policy, False, func, args, kwargs):
            self.store.append((func, tree_map(_detached, out)))
        return out

    def tensors(self) -> list[torch.Tensor]:
        """The kept outputs (held until SR has used them)."""
        out: list[torch.Tensor] = []
        for _, value in self.store:
            tree_map(lambda x: out.append(x) if isinstance(x, torch.Tensor) else None, value)
        return out


class Replaying(TorchDispatchMode):
    """SR's recompute of a region: an operation the policy saves gives back its stored
    output instead of running."""

    def __init__(self, policy: OpPolicy, store: list[tuple[Any, object]], where: str) -> None:
        super().__init__()
        self.policy, self.where = policy, where
        self.stored = iter(store)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> object:
        kwargs = kwargs or {}
        if not _saves(self.policy, True, func, args, kwargs):
            return func(*args, **kwargs)
        op, value = next(self.stored, (None, None))
        if op is not func:
            raise RunError(f"{self.where}: SR's recompute reached {func} where the forward "
                           f"saved {op} (does the Recompute policy decide the same in the "
                           "recompute as in the forward?)")
        return tree_map(_detached, value)
