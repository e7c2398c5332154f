"""The B/W split of ``nn.LSTM`` and ``nn.GRU``: the split forward computes what torch's does
(outputs and final states), B then W gives the fused backward's gradients (input, initial
state and every weight, float64, 1e-12), and W computes every weight's gradient; over layers,
directions, ``batch_first``, no bias, an initial state, an unbatched sequence and dropout
between layers. A packed sequence runs as torch runs it, its gradients in B."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from flexpipe.runtime.split import WeightWork, recorded_share, recording

CONFIGS: dict[str, dict[str, Any]] = {
    "one layer": {},
    "two layers, both ways": {"num_layers": 2, "bidirectional": True},
    "batch first, no bias": {"batch_first": True, "bias": False},
    "dropout between layers": {"num_layers": 3, "dropout": 0.3},
}
KINDS = {"lstm": nn.LSTM, "gru": nn.GRU}


def _outputs(out: Any) -> list[torch.Tensor]:
    """The output and every final state, flat."""
    seq, state = out
    return [seq, *(state if isinstance(state, tuple) else (state,))]


def _run(rnn: nn.Module, x: torch.Tensor, hx: Any, work: WeightWork | None
         ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs, then every gradient (input, state, weights) after one backward."""
    for p in rnn.parameters():
        p.grad = None
    xi = x.clone().requires_grad_(True)
    hs = None if hx is None else tuple(h.clone().requires_grad_(True) for h in hx)
    torch.manual_seed(3)
    with recording(work):
        outs = _outputs(rnn(xi, None if hs is None else hs if len(hs) > 1 else hs[0]))
    loss = sum((o * torch.linspace(0.5, 1.5, o.shape[-1], dtype=o.dtype)).sum() for o in outs)
    with work.backward_input() if work is not None else _nothing():
        loss.backward()
    if work is not None:
        assert recorded_share(rnn, work) == 1.0
        assert all(p.grad is None for p in rnn.parameters())  # every weight left to W
        work.run()
    grads = {"x": xi.grad, **{f"h{i}": h.grad for i, h in enumerate(hs or ())}}
    return [o.detach() for o in outs], grads | {n: p.grad for n, p in rnn.named_parameters()}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("given", [False, True])
def test_a_recurrent_layer_splits_like_its_fused_backward(kind: str, config: str,
                                                          given: bool) -> None:
    torch.manual_seed(0)
    rnn = KINDS[kind](5, 4, **CONFIGS[config]).double()
    split = (copy.deepcopy(rnn))
    first = CONFIGS[config].get("batch_first", False)
    x = torch.randn(3, 6, 5, dtype=torch.float64) if first \
        else torch.randn(6, 3, 5, dtype=torch.float64)
    dirs = 2 if rnn.bidirectional else 1
    parts = 2 if kind == "lstm" else 1
    hx = tuple(torch.randn(rnn.num_layers * dirs, 3, 4, dtype=torch.float64)
               for _ in range(parts)) if given else None
    want_out, want = _run(rnn, x, hx, None)
    got_out, got = _run(split, x, hx, WeightWork())
    for a, b in zip(got_out, want_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert got.keys() == want.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_unbatched_sequence_splits_too(kind: str) -> None:
    torch.manual_seed(0)
    rnn = KINDS[kind](5, 4).double()
    split = (copy.deepcopy(rnn))
    x = torch.randn(6, 5, dtype=torch.float64)
    want_out, want = _run(rnn, x, None, None)
    got_out, got = _run(split, x, None, WeightWork())
    for a, b in zip(got_out, want_out, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-12, atol=1e-14, msg=name)


def test_a_packed_sequence_splits_as_torch_computes_it() -> None:
    """A packed sequence's LSTM (``torch.lstm`` over data and batch sizes) splits like any
    product: B leaves every weight to W, and B then W gives the fused gradients to the bit."""
    torch.manual_seed(0)
    rnn = nn.LSTM(5, 4).double()
    split = copy.deepcopy(rnn)
    x = torch.randn(6, 3, 5, dtype=torch.float64, requires_grad=True)
    fused, _ = rnn(pack_padded_sequence(x, [6, 4, 2]))
    fused.data.sum().backward()
    work = WeightWork()
    with recording(work):
        out, _ = split(pack_padded_sequence(x.detach().requires_grad_(), [6, 4, 2]))
    with work.backward_input():
        out.data.sum().backward()
    assert work.pending and all(p.grad is None for p in split.parameters())
    work.run()
    for (name, p), q in zip(split.named_parameters(), rnn.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


class Exported(nn.Module):
    """A bidirectional two-layer LSTM, then a GRU; the shape branch makes torch.fx give up, so
    the model is exported (``aten.lstm``, ``aten.gru``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.gru = nn.GRU(8, 4, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lstm(x)[0]
        if h.shape[-1] == 8:
            h = h * 1.0
        return self.head(self.gru(h)[0])  # type: ignore[no-any-return]


def test_an_exported_recurrent_layer_splits_too() -> None:
    from test_wgrad_computed import _both, _same

    from flexpipe.runtime.user.tracing import split_points

    torch.manual_seed(0)
    x = torch.randn(3, 6, 5, dtype=torch.float64)
    cut = split_points(Exported().double(), ["gru"], ((x,), {}))
    stages = [(seg.layers[0]) for seg in cut.segments]
    h = stages[0](x)[0].detach().requires_grad_(True)
    for stage, run in ((stages[0], lambda: stages[0](x)[0]), (stages[1], lambda: stages[1](h)[0])):
        want, got, work = _both(stage, run)
        _same(got, want)
        assert work is not None and recorded_share(stage, work) == 1.0
