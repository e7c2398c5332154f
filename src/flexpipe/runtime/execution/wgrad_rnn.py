"""The B/W split of ``nn.LSTM`` and ``nn.GRU`` (``wgrad``'s store). torch computes a CPU
recurrent layer as its cells' products and gates; while a store records, the split forward
computes them the same way, step by step, with the products through the store's linear: the
input product over the whole sequence at once, then at every step the hidden state's product
and the gates. B then computes the input and state gradients; W the weights' (one product
for the input weights, one per step for the hidden weights). Sequences packed with
``pack_padded_sequence``, LSTM projections (``proj_size``) and any other input run as torch
runs them, their gradients in B. An exported layer (``aten.lstm``, ``aten.gru``) splits
the same way (``wgrad_aten.RULES``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from flexpipe.runtime.execution.wgrad import WeightWork, current, owned, split_linear

State = tuple[torch.Tensor, ...]
Cell = Callable[[torch.Tensor, State, torch.Tensor, torch.Tensor | None, WeightWork], State]
"""``cell(input product at t, state, hidden weight, hidden bias, work)`` -> the next state
(its first tensor the step's output)."""


def _lstm_cell(pre: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
               work: WeightWork) -> State:
    """torch's LSTM cell: gates = W_hh h + (W_ih x_t + b), then i, f, g, o."""
    h, c = state
    gates = split_linear(h, w_hh, b_hh, work) + pre
    i, f, g, o = gates.chunk(4, 1)
    c = f.sigmoid() * c + i.sigmoid() * g.tanh()
    return o.sigmoid() * c.tanh(), c


def _gru_cell(pre: torch.Tensor, state: State, w_hh: torch.Tensor, b_hh: torch.Tensor | None,
              work: WeightWork) -> State:
    """torch's GRU cell: reset and update gates, the new gate reading the reset hidden
    product."""
    (h,) = state
    ir, iz, in_ = pre.chunk(3, 1)
    hr, hz, hn = split_linear(h, w_hh, b_hh, work).chunk(3, 1)
    r = (hr + ir).sigmoid()
    z = (hz + iz).sigmoid()
    n = (in_ + hn * r).tanh()
    return ((h - n) * z + n,)


@dataclass(frozen=True)
class Recurrent:
    """A recurrent layer as torch's kernels take it: its weights flat (per layer and direction
    the input and hidden weights, then their biases with ``bias``), its shape and modes."""

    weights: Sequence[torch.Tensor]
    bias: bool
    layers: int
    dropout: float
    training: bool
    bidirectional: bool
    batch_first: bool

    @classmethod
    def of(cls, rnn: nn.RNNBase) -> Recurrent:
        """An ``nn.LSTM``'s or ``nn.GRU``'s."""
        return cls([w for w in rnn._flat_weights if w is not None],  # noqa: SLF001
                   rnn.bias, rnn.num_layers,
                   float(rnn.dropout), rnn.training, rnn.bidirectional, rnn.batch_first)

    def at(self, layer: int, reverse: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                      torch.Tensor | None, torch.Tensor | None]:
        """The input and hidden weights and biases of one layer and direction."""
        per, dirs = (4 if self.bias else 2), (2 if self.bidirectional else 1)
        w = self.weights[(layer * dirs + int(reverse)) * per:][:per]
        return w[0], w[1], (w[2] if self.bias else None), (w[3] if self.bias else None)

    def splits(self, x: Any) -> bool:
        """Whether a store records and this layer's run on ``x`` can be split."""
        return current() is not None and isinstance(x, torch.Tensor) and x.dim() in (2, 3) \
            and owned(*self.weights) and any(w.requires_grad for w in self.weights)


def _direction(spec: Recurrent, cell: Cell, x: torch.Tensor, state: State, layer: int,
               reverse: bool, work: WeightWork) -> tuple[torch.Tensor, State]:
    """One layer in one direction over the sequence ``x`` (time first): its outputs and its
    last state."""
    w_ih, w_hh, b_ih, b_hh = spec.at(layer, reverse)
    pre = split_linear(x, w_ih, b_ih, work)
    outs: list[torch.Tensor] = [pre] * x.shape[0]
    for t in (reversed(range(x.shape[0])) if reverse else range(x.shape[0])):
        state = cell(pre[t], state, w_hh, b_hh, work)
        outs[t] = state[0]
    return torch.stack(outs), state


def _layers(spec: Recurrent, cell: Cell, x: torch.Tensor, state: State, work: WeightWork
            ) -> tuple[torch.Tensor, State]:
    """Every layer and direction (input time first, state per layer x direction): the last
    layer's outputs and every final state, stacked as torch stacks them."""
    dirs = 2 if spec.bidirectional else 1
    finals: list[State] = []
    for layer in range(spec.layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, last = _direction(spec, cell, x, tuple(s[k] for s in state), layer, d == 1,
                                   work)
            outs.append(out)
            finals.append(last)
        x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if spec.dropout and spec.training and layer < spec.layers - 1:
            x = torch.nn.functional.dropout(x, spec.dropout, True)
    return x, tuple(torch.stack([f[i] for f in finals]) for i in range(len(state)))


def run(spec: Recurrent, cell: Cell, parts: int, input: torch.Tensor, hx: Any
        ) -> tuple[torch.Tensor, State]:
    """The split run of a recurrent layer (``parts``: tensors in its state, ``hx`` them or
    None): its output and final states, shaped as torch returns them."""
    work = current()
    assert work is not None
    unbatched = input.dim() == 2
    x = input.unsqueeze(1) if unbatched else input.transpose(0, 1) if spec.batch_first \
        else input
    if hx is None:
        hidden = spec.at(0, False)[1].shape[1]
        dirs = 2 if spec.bidirectional else 1
        state: State = (x.new_zeros(spec.layers * dirs, x.shape[1], hidden),) * parts
    else:
        given = tuple(hx) if isinstance(hx, tuple | list) else (hx,)
        state = tuple(s.unsqueeze(1) for s in given) if unbatched else given
    out, last = _layers(spec, cell, x, state, work)
    out = out.squeeze(1) if unbatched else out.transpose(0, 1) if spec.batch_first else out
    return out, (tuple(s.squeeze(1) for s in last) if unbatched else last)


def lstm_forward(self: nn.LSTM, input: Any, hx: Any = None) -> Any:
    """``nn.LSTM``'s forward, split while a store records."""
    spec = Recurrent.of(self)
    if isinstance(input, PackedSequence) or self.proj_size or not spec.splits(input):
        return nn.LSTM.forward(self, input, hx)
    out, last = run(spec, _lstm_cell, 2, input, hx)
    return out, last


def gru_forward(self: nn.GRU, input: Any, hx: Any = None) -> Any:
    """``nn.GRU``'s forward, split while a store records."""
    spec = Recurrent.of(self)
    if isinstance(input, PackedSequence) or not spec.splits(input):
        return nn.GRU.forward(self, input, hx)
    out, last = run(spec, _gru_cell, 1, input, hx)
    return out, last[0]


def aten_lstm(work: WeightWork, input: Any, hx: Sequence[torch.Tensor],
              params: Sequence[torch.Tensor], has_biases: bool, num_layers: int,
              dropout: float, train: bool, bidirectional: bool, batch_first: bool
              ) -> tuple[torch.Tensor, ...] | None:
    """``aten.lstm.input`` (an exported ``nn.LSTM``), split; None where it cannot be."""
    spec = Recurrent(list(params), has_biases, num_layers, dropout, train, bidirectional,
                     batch_first)
    if len(params) != num_layers * (2 if bidirectional else 1) * (4 if has_biases else 2) \
            or not spec.splits(input):
        return None  # LSTM projections carry a fifth weight
    out, (h, c) = run(spec, _lstm_cell, 2, input, tuple(hx))
    return out, h, c


def aten_gru(work: WeightWork, input: Any, hx: torch.Tensor, params: Sequence[torch.Tensor],
             has_biases: bool, num_layers: int, dropout: float, train: bool,
             bidirectional: bool, batch_first: bool) -> tuple[torch.Tensor, ...] | None:
    """``aten.gru.input`` (an exported ``nn.GRU``), split; None where it cannot be."""
    spec = Recurrent(list(params), has_biases, num_layers, dropout, train, bidirectional,
                     batch_first)
    if not spec.splits(input):
        return None
    out, (h,) = run(spec, _gru_cell, 1, input, hx)
    return out, h
