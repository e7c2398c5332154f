"""The B/W split of ``nn.LSTM`` and ``nn.GRU`` (``wgrad``'s store). torch computes a CPU
recurrent layer as its cells' products and gates; while a store records, the split forward
computes them the same way, step by step, with the products through the store's linear: the
input product over the whole sequence at once, then at every step the hidden state's product
and the gates. B then computes the input and state gradients; W the weights' (one product
for the input weights, one per step for the hidden weights). Sequences packed with
``pack_padded_sequence``, LSTM projections (``proj_size``) and any other input run as torch
runs them, their gradients in B."""

from __future__ import annotations

from collections.abc import Callable
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


def _weights(rnn: nn.RNNBase, layer: int, reverse: bool) -> list[torch.Tensor | None]:
    suffix = f"_l{layer}{'_reverse' if reverse else ''}"
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    return [getattr(rnn, n + suffix) if rnn.bias or n.startswith("weight") else None
            for n in names]


def _direction(rnn: nn.RNNBase, cell: Cell, x: torch.Tensor, state: State, layer: int,
               reverse: bool, work: WeightWork) -> tuple[torch.Tensor, State]:
    """One layer in one direction over the sequence ``x`` (time first): its outputs and its
    last state."""
    w_ih, w_hh, b_ih, b_hh = _weights(rnn, layer, reverse)
    assert w_ih is not None and w_hh is not None
    pre = split_linear(x, w_ih, b_ih, work)
    outs: list[torch.Tensor] = [pre] * x.shape[0]
    for t in (reversed(range(x.shape[0])) if reverse else range(x.shape[0])):
        state = cell(pre[t], state, w_hh, b_hh, work)
        outs[t] = state[0]
    return torch.stack(outs), state


def _run(rnn: nn.RNNBase, cell: Cell, x: torch.Tensor, state: State, work: WeightWork
         ) -> tuple[torch.Tensor, State]:
    """Every layer and direction of ``rnn`` (input time first, state per layer x direction):
    the last layer's outputs and every final state, stacked as torch stacks them."""
    dirs = 2 if rnn.bidirectional else 1
    finals: list[State] = []
    for layer in range(rnn.num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            out, last = _direction(rnn, cell, x, tuple(s[k] for s in state), layer, d == 1,
                                   work)
            outs.append(out)
            finals.append(last)
        x = torch.cat(outs, -1) if dirs == 2 else outs[0]
        if rnn.dropout and rnn.training and layer < rnn.num_layers - 1:
            x = torch.nn.functional.dropout(x, rnn.dropout, True)
    return x, tuple(torch.stack([f[i] for f in finals]) for i in range(len(state)))


def _split(rnn: nn.RNNBase, cell: Cell, parts: int, native: Callable[..., Any],
           input: Any, hx: Any) -> Any:
    """The split forward of ``rnn`` (``parts``: tensors in its state), or ``native``."""
    work = current()
    weights = [w for w in rnn._flat_weights if w is not None]  # noqa: SLF001 - torch's list
    if work is None or isinstance(input, PackedSequence) or bool(getattr(rnn, "proj_size", 0)) \
            or not owned(*weights) or not any(w.requires_grad for w in weights) \
            or input.dim() not in (2, 3):
        return native(rnn, input, hx)
    unbatched = input.dim() == 2
    x = input.unsqueeze(1) if unbatched else input.transpose(0, 1) if rnn.batch_first \
        else input
    dirs = 2 if rnn.bidirectional else 1
    if hx is None:
        zeros = x.new_zeros(rnn.num_layers * dirs, x.shape[1], rnn.hidden_size)
        state: State = (zeros,) * parts
    else:
        given = tuple(hx) if isinstance(hx, tuple | list) else (hx,)
        state = tuple(s.unsqueeze(1) for s in given) if unbatched else given
    out, last = _run(rnn, cell, x, state, work)
    out = out.squeeze(1) if unbatched else out.transpose(0, 1) if rnn.batch_first else out
    last = tuple(s.squeeze(1) for s in last) if unbatched else last
    return out, (last if parts == 2 else last[0])


def lstm_forward(self: nn.LSTM, input: Any, hx: Any = None) -> Any:
    """``nn.LSTM``'s forward, split while a store records."""
    return _split(self, _lstm_cell, 2, nn.LSTM.forward, input, hx)


def gru_forward(self: nn.GRU, input: Any, hx: Any = None) -> Any:
    """``nn.GRU``'s forward, split while a store records."""
    return _split(self, _gru_cell, 1, nn.GRU.forward, input, hx)
