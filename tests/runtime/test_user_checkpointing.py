"""A model that checkpoints its own activations (``torch.utils.checkpoint``, reentrant or not,
or Hugging Face's ``gradient_checkpointing_enable()``), cut into stages by torch.fx or
torch.export: the stages compute every gradient (a reentrant checkpoint exported as it runs
would compute its blocks without a graph: a Hugging Face GPT-2 trained none of its parameters),
the checkpointed modules become the regions selective recompute drops (``Core``s, no warning),
and the model keeps its settings."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import user_models as um
from torch import nn
from torch.utils.checkpoint import checkpoint

from flexpipe.runtime.execution.selective import Core
from flexpipe.runtime.user.tracing import split_points


class Checkpointed(nn.Module):
    """A block in the middle checkpointed; ``export`` branches on a shape (torch.fx cannot)."""

    def __init__(self, reentrant: bool, export: bool) -> None:
        super().__init__()
        self.reentrant, self.export = reentrant, export
        self.a = nn.Linear(4, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.export and h.shape[-1] == 8:
            h = h * 1.0
        h = checkpoint(self.b, h, use_reentrant=self.reentrant)
        return self.c(torch.tanh(h))  # type: ignore[no-any-return]


def _stage_grads(model: nn.Module, points: list[str], x: torch.Tensor,
                 loss: object) -> list[torch.Tensor | None]:
    """Every trainable parameter's gradient after the cut model's forward and backward in one
    process (stage by stage, as the pipeline hands them over)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cut = split_points(model, points, x)
    stages = [(seg.layers[0]) for seg in cut.segments]
    assert any(isinstance(m, Core) for s in stages for m in s.modules())  # the checkpoints
    out0 = stages[0](x)
    inner = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in out0)
    value = loss(stages[1](*inner)[0])  # type: ignore[operator]
    assert value.requires_grad
    value.backward()
    pairs = [(o, i.grad) for o, i in zip(out0, inner, strict=True) if i.grad is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    order = {id(p): i for i, p in enumerate(model.parameters())}  # the model's own order
    params = sorted((p for s in stages for p in s.parameters() if p.requires_grad),
                    key=lambda p: order[id(p)])
    return [p.grad for p in params]


@pytest.mark.parametrize("export", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_block_keeps_its_gradients(reentrant: bool, export: bool) -> None:
    torch.manual_seed(0)
    model = Checkpointed(reentrant, export).double()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64)
    got = _stage_grads(model, ["c"], x, lambda y: y.square().sum())
    ref(x).square().sum().backward()
    want = sorted((p.grad for p in ref.parameters()), key=lambda g: g.shape)
    assert all(g is not None for g in got)
    have = sorted((g for g in got if g is not None), key=lambda g: g.shape)
    assert len(have) == len(want)
    total = sum(float(g.norm()) for g in want)
    assert sum(float((a - b).norm()) for a, b in zip(have, want, strict=True)) <= 1e-12 * total


def test_hugging_face_gradient_checkpointing_trains_every_parameter() -> None:
    """``gradient_checkpointing_enable()`` (reentrant by default): exported at a block, both
    stages give every parameter its gradient, equal to the plain model's; the model's layers
    still checkpoint afterwards."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = um.gpt2()
    plain = copy.deepcopy(model)
    model.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    x, y = um.tokens(0, 2)
    got = _stage_grads(model, ["lm.transformer.h.2"], x, lambda out: um.lm_loss(out, y))
    assert all(g is not None for g in got)
    um.lm_loss(plain(x), y).backward()
    norms = sorted(float(g.norm()) for g in got if g is not None)
    want = sorted(float(p.grad.norm()) for p in plain.parameters() if p.grad is not None)
    assert len(norms) == len(want)
    assert max(abs(a - b) / max(b, 1e-12) for a, b in zip(norms, want, strict=True)) < 1e-9
    assert all(m.gradient_checkpointing for m in model.modules()
               if hasattr(m, "gradient_checkpointing") and m is not model)
    with contextlib.suppress(AttributeError):
        assert model.lm.is_gradient_checkpointing
