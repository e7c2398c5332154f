"""The module one traced stage runs (``TracedStage``): its piece of the model's graph, the
positions of what it takes and hands on in its producers' outputs, and the parameters and
buffers the piece reads outside submodules, grouped per repeated block of the model so that
FSDP2 can shard each block as a unit (``block_key``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flexpipe.errors import ConfigError
from flexpipe.runtime.user.devices import compute_device, retarget
from flexpipe.runtime.user.randomness import training


class TracedStage(nn.Module):
    """One traced stage: takes its producers' outputs (or, on stage 0, the batch inputs) as one
    flat tuple, calls its piece of the graph on the ones it uses and returns the values later
    stages (or the loss) need."""

    def __init__(self, piece: nn.Module, args: tuple[int, ...], outs: tuple[int, ...],
                 multi: bool, name: str, consts: Sequence[torch.Tensor] = (),
                 const_names: Sequence[str] = ()) -> None:
        super().__init__()
        self.piece = piece
        self.args, self.outs, self.multi, self.name = args, outs, multi, name
        self.consts = nn.Module()
        """Parameters and buffers the model reads outside a submodule (``self.pos``; all of
        them in an exported graph), which the piece takes as arguments: ``args`` index -1 is
        ``c0``, -2 ``c1``, ... Those of one repeated block of the model (``const_names``, the
        model's names: ``model.layers.3.mlp.up_proj.weight``) sit together in a module
        ``consts.<k>`` of their own (the k-th block), so that FSDP2 can shard each block as a
        unit (``engines.blocks``)."""
        self.holders: list[nn.Module] = []
        """Per constant ``c{j}``, the module holding it."""
        groups: dict[str, nn.Module] = {}
        for j, t in enumerate(consts):
            key = block_key(const_names[j]) if j < len(const_names) else None
            if key is not None and key not in groups:
                groups[key] = nn.Module()
                self.consts.add_module(str(len(groups) - 1), groups[key])
            self._hold(j, t, self.consts if key is None else groups[key])
        self.placed: torch.device | None = None
        """The device the piece's graphs create their tensors on, once known (``retarget``)."""
        self.eval_piece: nn.Module | None = None
        """The piece of the model's eval-mode graph, where it differs (``modes``)."""
        self.eval_args: tuple[int, ...] = args

    def _hold(self, j: int, t: torch.Tensor, holder: nn.Module) -> None:
        """Register constant ``c{j}`` (a parameter or a buffer) on ``holder``."""
        if isinstance(t, nn.Parameter):
            holder.register_parameter(f"c{j}", t)
        else:
            holder.register_buffer(f"c{j}", t)
        self.holders.append(holder)

    def keep_eval(self, other: TracedStage) -> None:
        """Run ``other``'s piece (the same stage of the eval-mode graph) in eval mode; the
        parameters and buffers it reads outside submodules are taken from this stage's."""
        mine = {id(t): j for j, t in enumerate(self._consts())}
        theirs = other._consts()
        for t in theirs:
            if id(t) not in mine:
                mine[id(t)] = len(mine)
                self._hold(mine[id(t)], t, self.consts)
        self.eval_piece = other.piece
        self.eval_args = tuple(i if i >= 0 else -1 - mine[id(theirs[-i - 1])]
                               for i in other.args)

    def _consts(self) -> list[torch.Tensor]:
        """The parameters and buffers the piece takes as arguments, ``c0`` first."""
        return [getattr(holder, f"c{j}") for j, holder in enumerate(self.holders)]

    def _place(self, flat: tuple[torch.Tensor, ...]) -> None:
        """Before a forward on a new device: the graphs create their tensors there."""
        device = compute_device(self, flat)
        if device is not None and device != self.placed:
            for piece in (self.piece, self.eval_piece):
                if piece is not None:
                    retarget(piece, device)
            self.placed = device

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Run the piece; pick the exported values from (inputs + own outputs). An exported
        graph switches gradient mode itself (``_set_grad_enabled`` around a model's
        ``no_grad`` blocks); the mode it found is restored even when the graph raises."""
        self._place(flat)
        piece, args = (self.piece, self.args) if self.training or self.eval_piece is None \
            else (self.eval_piece, self.eval_args)
        with training(self.training), torch.set_grad_enabled(torch.is_grad_enabled()):
            res = piece(*(flat[i] if i >= 0 else getattr(self.holders[-i - 1], f"c{-i - 1}")
                          for i in args))
        table = tuple(flat) + (tuple(res) if self.multi else (res,))
        out = tuple(table[i] for i in self.outs)
        bad = [i for i, t in enumerate(out) if not isinstance(t, torch.Tensor)]
        if bad:
            raise ConfigError(f"{self.name}: value {bad[0]} it hands on is a "
                              f"{type(out[bad[0]]).__name__}, not a tensor; only tensors "
                              "cross stage boundaries (move the split point)")
        return out


def block_key(name: str) -> str | None:
    """The repeated block a model name is in: its path up to the first index
    (``model.layers.3`` of ``model.layers.3.mlp.up_proj.weight``); None outside any."""
    parts = name.split(".")
    at = next((i for i, part in enumerate(parts[:-1]) if part.isdigit()), None)
    return None if at is None else ".".join(parts[:at + 1])
