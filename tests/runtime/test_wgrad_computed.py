"""The B/W split of weights a model computes from its parameters: a layer under
``weight_norm`` or ``spectral_norm`` (the parametrizations and the older hooks), pruning's
``weight * mask``, a cast, ``2 * self.w`` or an expanded view in a traced or exported graph.
B leaves the weight's own graph alone; W computes the weight's gradient and differentiates
through that graph into the parameters. Checked in one process against one fused backward
(float64, to the bit), with W computing every such parameter's gradient; a computed weight
that something other than a product also reads stays in B, as exact."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as fn
from torch.nn.utils import parametrizations, prune

from flexpipe.runtime.split import WeightWork, recorded_share, recording
from flexpipe.runtime.user.tracing import split_points

WIDTH = 6


def _old_weight_norm(layer: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return nn.utils.weight_norm(layer)


def _pruned(layer: nn.Module) -> nn.Module:
    return prune.random_unstructured(layer, "weight", amount=0.3)


NORMS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "weight_norm": parametrizations.weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "old weight_norm": _old_weight_norm,
    "old spectral_norm": nn.utils.spectral_norm,
    "pruned": _pruned,
}
"""How a user re-parametrizes a layer's weight."""

LAYERS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "linear": (lambda: nn.Linear(WIDTH, WIDTH),
               lambda: torch.randn(2, 3, WIDTH, requires_grad=True)),
    "conv1d": (lambda: nn.Conv1d(WIDTH, WIDTH, 3, padding=1),
               lambda: torch.randn(2, WIDTH, 5, requires_grad=True)),
    "conv2d": (lambda: nn.Conv2d(WIDTH, WIDTH, 3, stride=2),
               lambda: torch.randn(2, WIDTH, 5, 5, requires_grad=True)),
    "conv-transpose1d": (lambda: nn.ConvTranspose1d(WIDTH, WIDTH, 3, stride=2),
                         lambda: torch.randn(2, WIDTH, 4, requires_grad=True)),
    "embedding": (lambda: nn.Embedding(10, WIDTH), lambda: torch.tensor([[1, 4, 4], [9, 0, 2]])),
    "embedding-bag": (lambda: nn.EmbeddingBag(10, WIDTH),
                      lambda: torch.tensor([[1, 4, 4], [9, 0, 2]])),
}
"""A layer with a weight, and an input for it."""


def _grads(module: nn.Module, run: Callable[[], torch.Tensor], split: bool
           ) -> tuple[dict[str, torch.Tensor | None], WeightWork | None]:
    """Every parameter's gradient after one backward of ``run()`` (fused, or B then W), and
    the split's work (its B done, its W run)."""
    for p in module.parameters():
        p.grad = None
    work = WeightWork() if split else None
    with recording(work):
        out = run()
    with work.backward_input() if work is not None else contextlib.nullcontext():
        out.square().sum().backward()
    if work is not None:
        assert all(p.grad is None for p in _deferred(module, work))  # left to W
        work.run()
    return {n: None if p.grad is None else p.grad.clone()
            for n, p in module.named_parameters()}, work


def _both(module: nn.Module, run: Callable[[], torch.Tensor]
          ) -> tuple[dict[str, torch.Tensor | None], dict[str, torch.Tensor | None],
                     WeightWork | None]:
    """The fused gradients, the split ones and the split's work, each from the same state
    (a spectral norm's forward moves its power iteration's vectors)."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    want, _ = _grads(module, run, split=False)
    with torch.no_grad():
        module.load_state_dict(state)
    got, work = _grads(module, run, split=True)
    return want, got, work


def _deferred(module: nn.Module, work: WeightWork) -> list[torch.Tensor]:
    return [p for p in module.parameters() if id(p) in work.deferred]


def _same(got: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor | None]) -> None:
    assert got.keys() == want.keys()
    for name, g in got.items():
        w = want[name]
        assert (g is None) == (w is None), name
        if g is not None and w is not None:  # to the bit but where a product's layout differs
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15, msg=name)


def _build(norm: str, layer: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    make, data = LAYERS[layer]
    module = nn.Sequential(NORMS[norm](make()), nn.Tanh()).double()
    x = data()
    x = x.double().detach().requires_grad_(True) if x.is_floating_point() else x
    return (module), lambda: module(x)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("norm", list(NORMS))
def test_a_re_parametrized_layer_defers_its_parameters(norm: str, layer: str) -> None:
    """Each way a user re-parametrizes a weight, on each kind of layer: B then W gives the
    fused backward's gradients to the bit, and W computes every trainable parameter's."""
    if norm == "orthogonal" and layer != "linear":
        pytest.skip("orthogonal is for matrices")
    module, run = _build(norm, layer)
    want, got, work = _both(module, run)
    _same(got, want)
    assert work is not None and recorded_share(module, work) == 1.0


def test_micro_batches_accumulate_like_autograd() -> None:
    """Two split micro-batches of a weight-normed layer, their W run after both B: the
    gradients one process accumulates over the two."""
    module, run = _build("weight_norm", "linear")
    want: dict[str, torch.Tensor] = {}
    for _ in range(2):
        with recording(None):
            run().square().sum().backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters()}
    for p in module.parameters():
        p.grad = None
    works = [WeightWork(), WeightWork()]
    outs = []
    for work in works:
        with recording(work):
            outs.append(run())
    for work, out in zip(works, outs, strict=True):
        with work.backward_input():
            out.square().sum().backward()
    for work in works:
        work.run()
    for n, p in module.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-12, atol=0), n


GRAPHS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "scaled": lambda x, w, g: x @ (2 * w),
    "gain": lambda x, w, g: fn.linear(x, g[:, None] * w),
    "hand-written weight norm": lambda x, w, g: fn.linear(
        x, g[:, None] * w / w.norm(dim=1, keepdim=True)),
    "expanded": lambda x, w, g: x[..., :1] @ g[None, :].expand(1, WIDTH),
    "transposed": lambda x, w, g: x @ (w * g).T,
    "twice": lambda x, w, g: (x @ (2 * w)) @ (2 * w).T,
}
"""A product whose weight the traced forward computes from parameters ``w`` and ``g``."""


class Computes(nn.Module):
    """``GRAPHS[name]`` between two linear layers."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.a, self.b = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))
        self.g = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = GRAPHS[self.name](torch.tanh(self.a(x)), self.w, self.g)
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("name", list(GRAPHS))
def test_a_weight_the_traced_graph_computes_is_deferred(name: str) -> None:
    """Traced by torch.fx: the computed weight's parameters go to W, exactly."""
    torch.manual_seed(0)
    module = (torch.fx.symbolic_trace(Computes(name).double()))
    x = torch.randn(2, 3, WIDTH, dtype=torch.float64, requires_grad=True)
    want, _ = _grads(module, lambda: module(x), split=False)
    got, work = _grads(module, lambda: module(x), split=True)
    _same(got, want)
    assert work is not None
    assert {id(p) for n, p in module.named_parameters() if got[n] is not None} \
        == set(work.deferred)


class ReadTwice(nn.Module):
    """A computed weight that a product and a sum both read."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = 2 * self.w
        return self.a(x) @ w + w.sum()


def test_a_computed_weight_read_outside_a_product_is_exact() -> None:
    """The sum reads the computed weight after the product did: that read goes through W too
    (its graph lives until W), so every gradient is W's, and exact."""
    torch.manual_seed(0)
    module = (torch.fx.symbolic_trace(ReadTwice().double()))
    x = torch.randn(2, 3, WIDTH, dtype=torch.float64, requires_grad=True)
    want, _ = _grads(module, lambda: module(x), split=False)
    got, work = _grads(module, lambda: module(x), split=True)
    _same(got, want)
    assert work is not None and {id(p) for p in module.parameters()} == set(work.deferred)


def test_an_activation_computed_from_embeddings_alone_is_not_a_weight() -> None:
    """A first stage's activations are computed from its parameters alone too (an embedding
    of integer ids): a product of two of them (attention's scores) stays a product of
    activations, exact."""

    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, WIDTH)
            self.q = nn.Linear(WIDTH, WIDTH)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            return torch.softmax(self.q(h) @ h.mT, -1) @ h

    torch.manual_seed(0)
    module = (torch.fx.symbolic_trace(Scores().double()))
    ids = torch.tensor([[1, 4, 4], [9, 0, 2]])
    want, _ = _grads(module, lambda: module(ids), split=False)
    got, work = _grads(module, lambda: module(ids), split=True)
    _same(got, want)
    assert work is not None and recorded_share(module, work) == 1.0


class Exported(nn.Module):
    """Weight norm, spectral norm and a computed product weight; ``export`` takes a branch
    on a shape that torch.fx cannot trace, so the model is exported."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, WIDTH)
        self.a = parametrizations.weight_norm(nn.Linear(WIDTH, WIDTH))
        self.b = parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH))
        self.w = nn.Parameter(torch.randn(WIDTH, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.emb(ids)))
        if h.shape[-1] == WIDTH:
            h = 2 * h
        return self.b(h) @ (2 * self.w)


def test_an_exported_model_defers_its_computed_weights() -> None:
    """Exported by torch.export and cut in two: each stage's split equals its fused
    backward to the bit, and W computes every one of its parameters' gradients."""
    ids = torch.tensor([[1, 4, 4], [9, 0, 2]])
    torch.manual_seed(0)
    cut = split_points(Exported().double(), ["b"], ((ids,), {}))
    stages = [(seg.layers[0]) for seg in cut.segments]
    h = stages[0](ids)[0].detach().requires_grad_(True)
    runs = ((stages[0], lambda: stages[0](ids)[0]), (stages[1], lambda: stages[1](h)[0]))
    for stage, run in runs:
        want, got, work = _both(stage, run)
        _same(got, want)
        assert work is not None and recorded_share(stage, work) == 1.0


def test_a_hooked_weight_read_outside_a_product_is_named_in_w() -> None:
    """An older ``weight_norm`` keeps its computed weight as the layer's attribute: read by
    something other than a product, B frees its graph, and W says so (which weight, why)
    instead of dropping the gradient."""
    torch.manual_seed(0)
    layer = (_old_weight_norm(nn.Linear(WIDTH, 4).double()))
    work = WeightWork()
    with recording(work):
        out = layer(torch.randn(3, WIDTH, dtype=torch.float64, requires_grad=True))
    with work.backward_input():
        (out.sum() + layer.weight.sum()).backward()
    with pytest.raises(RuntimeError, match=r"weight of shape \(4, 6\) computed from "
                                           r"parameters .* B freed its graph"):
        work.run()


@pytest.mark.parametrize("layer", ["linear", "conv1d", "conv-transpose1d"])
def test_a_frozen_weight_leaves_its_trained_bias_to_w(layer: str) -> None:
    """A bias-only fine-tune (the weight frozen): W computes the bias's gradient, exactly."""
    torch.manual_seed(0)
    make, data = LAYERS[layer]
    module = (nn.Sequential(make(), nn.Tanh()).double())
    module[0].weight.requires_grad_(False)
    x = data().double().detach().requires_grad_(True)
    want, _ = _grads(module, lambda: module(x), split=False)
    got, work = _grads(module, lambda: module(x), split=True)
    _same(got, want)
    assert work is not None and set(work.deferred) == {id(module[0].bias)}
