"""The B/W split on the models people train (``tiny_models``: Hugging Face GPT-2, BERT, ViT,
T5, Llama (also fine-tuned in part: frozen embeddings, first block and norms) and a Mixtral
mixture of experts (its experts as batched and as grouped products)
exported by torch.export, a user's CNN with
BatchNorm and residuals traced by torch.fx), cut into stages as ``flexpipe.pipeline`` cuts
them. In one process: B then W gives the gradients of one fused backward (float64, 1e-9), W
computes the gradient of >= 90% of every stage's weight elements (B leaves exactly those
without a gradient), and after B nothing of the forward is alive but what W reads. At 2 gloo
ranks (the shared 2-process launch, ``shared_launch``): ZB-H1 and ZB-V train them like one
device."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import shared_launch
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.runtime.execution.activations import ActivationMeter
from flexpipe.runtime.split import WeightWork, recorded_share, recording
from flexpipe.runtime.user.tracing import split_points

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")
import tiny_models as tm  # noqa: E402 - needs transformers

RTOL = 1e-9


def _rel(a: torch.Tensor, b: torch.Tensor, scale: float = 0.0) -> float:
    """|a - b| / |b|, with |b| at least ``scale`` (a gradient that is zero in exact arithmetic,
    such as BERT's key bias, is compared against the model's gradient scale, not its own
    rounding noise)."""
    return float((a - b).norm() / max(float(b.norm()), scale, 1e-300))


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The worst relative error of ``got``, each gradient against ``want``'s, floored at
    1e-6 of the norm of all of ``want``."""
    scale = 1e-6 * float(torch.cat([w.flatten() for w in want]).norm())
    return max(_rel(a, b, scale) for a, b in zip(got, want, strict=True))


class Run:
    """One micro-batch through the stages of a 2-stage cut, fused or split (B, then W)."""

    def __init__(self, name: str) -> None:
        case = tm.MODELS[name]
        torch.manual_seed(0)
        self.case = case
        self.x, self.y = case.batch(0, 2)
        traced = split_points(case.build(), case.points2, self.x)
        self.stages = [(seg.layers[0]) for seg in traced.segments]
        self.works: list[WeightWork | None] = [None, None]
        self.meter = ActivationMeter.of(self.stages)

    def grads(self, split: bool) -> list[torch.Tensor]:
        """Every parameter's gradient after one backward (the stages' ``.grad`` cleared)."""
        self.backward_input(split)
        for work in self.works:
            if work is not None:
                work.run()
        params = self.trained()
        out = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out

    def trained(self, k: int | None = None) -> list[nn.Parameter]:
        """The parameters that train (of stage ``k``; None: of both), not the frozen ones."""
        stages = self.stages if k is None else self.stages[k:k + 1]
        return [p for s in stages for p in s.parameters() if p.requires_grad]

    def backward_input(self, split: bool) -> None:
        """F of both stages (recorded when split), then B (or BW) of stage 1 and stage 0."""
        self.works = [WeightWork(), WeightWork()] if split else [None, None]
        with recording(self.works[0]), self.meter.saving():
            out0 = self.stages[0](*self.x)
        inner = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in out0)
        with recording(self.works[1]), self.meter.saving():
            out1 = self.stages[1](*inner)
        loss = self.case.loss(out1[0], self.y)
        self.meter.record(*out0, *out1, *(k for w in self.works if w for k in w.kept))
        with self._deferring(1):
            torch.autograd.backward([loss], inputs=[t for t in inner if t.requires_grad]
                                    + self.trained(1))
        pairs = [(o, i.grad) for o, i in zip(out0, inner, strict=True)
                 if o.requires_grad and i.grad is not None]
        if pairs and self.trained(0):
            with self._deferring(0):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs],
                                        inputs=self.trained(0))

    def _deferring(self, k: int) -> contextlib.AbstractContextManager[None]:
        work = self.works[k]
        return work.backward_input() if work is not None else contextlib.nullcontext()


@pytest.mark.parametrize("name", list(tm.MODELS))
def test_split_backward_equals_fused_and_defers_the_weights(name: str) -> None:
    run = Run(name)
    fused = run.grads(split=False)
    run.backward_input(split=True)
    shares = [recorded_share(s, w) for s, w in zip(run.stages, run.works, strict=True)
              if w is not None]
    assert min(shares) >= 0.9, (name, shares)
    deferred = {i for w in run.works if w is not None for i in w.deferred}
    for p in run.trained():
        assert (p.grad is None) == (id(p) in deferred), name
    for w in run.works:
        assert w is not None
        w.run()
    split = [p.grad for p in run.trained()]
    worst = _worst(split, fused)
    assert worst <= RTOL, (name, worst)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral", "mixtral-grouped", "cnn"])
def test_after_b_only_what_w_reads_is_alive(name: str) -> None:
    """The forward's saved tensors and outputs, once B has run, are freed but for W's
    (input, output gradient) pairs: every live recorded byte is one W holds."""
    run = Run(name)
    run.backward_input(split=True)
    works = [w for w in run.works if w is not None]
    held = {t.untyped_storage().data_ptr() for w in works for t in w.held}
    run.meter.live()
    alive = set(run.meter.held)
    assert alive <= held, (name, len(alive - held))
    for w in works:
        w.run()
    run.meter.live()
    inputs = {t.untyped_storage().data_ptr() for t in run.x}  # the batch, read by embeddings
    assert set(run.meter.held) <= inputs, name


def train(name: str, schedule: str, auto: bool = False) -> float:
    """On one rank: one pipelined step of a model (4 stages for ZB-V, 2 else, 4 micro-batches)
    next to one device's; the worst relative error of the gradients (and the loss). ``auto``:
    no split points (``flexpipe.pipeline`` chooses them)."""
    case = tm.MODELS[name]
    torch.manual_seed(0)
    model = case.build()
    ref = copy.deepcopy(model)
    case.eager(ref)
    points = () if auto else case.points4 if schedule == "zb-v" else case.points2
    x, y = case.batch(1, 8)
    pipe = flexpipe.pipeline(model, schedule, loss_fn=case.loss, m=4, split_points=points,
                             example=case.batch(0, 2)[0])
    loss = pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    # one device, micro-batch by micro-batch (BatchNorm normalises each micro-batch on its own)
    parts = zip(*(t.chunk(4) for t in x), y.chunk(4), strict=True)
    ref_loss = sum(case.loss(ref(*xy[:-1]), xy[-1]) for xy in parts) / 4
    assert isinstance(ref_loss, torch.Tensor)
    ref_loss.backward()
    want = dict(ref.named_parameters())
    mine = [(n, p) for n, p in pipe.named_parameters() if p.requires_grad]
    assert all(p.grad is None for _, p in pipe.named_parameters() if not p.requires_grad)
    errs = [_worst([p.grad for _, p in mine], [want[n].grad for n, _ in mine])]
    if loss is not None:
        errs.append(_rel(torch.as_tensor(loss), ref_loss.detach()))
    return max(errs)


CASES = [("llama", "zb-v"), ("llama-frozen", "zb-v"), ("llama-frozen", "zb-h1"),
         ("t5", "zb-h1"), ("mixtral", "zb-v"), ("mixtral-grouped", "zb-v"),
         ("cnn", "zb-v")]


def _all(cases: list[tuple[str, str]]) -> list[float]:
    return [train(*c) for c in cases]


shared_launch.register(2, "wgrad-models", lambda: (_all, (CASES,)))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_zero_bubble_schedules_train_the_models_like_one_device() -> None:
    results: list[Any] = shared_launch.results(2, "wgrad-models")
    for i, case in enumerate(CASES):
        worst = max(r[i] for r in results)
        assert worst <= RTOL, (case, worst)


VIEWS = {
    "T": lambda w, x: x @ w.T,  # Falcon's linear layers
    "t": lambda w, x: torch.mm(x.reshape(-1, 4), w.t()).reshape(2, 3, 5),
    "transpose": lambda w, x: torch.matmul(x, w.transpose(0, 1)),
    "left": lambda w, x: (w @ x.mT).mT,  # Mamba's dt_proj.weight @ x
    "left-mm": lambda w, x: torch.mm(w, x.reshape(-1, 4).t()).t().reshape(2, 3, 5),
    "slice": lambda w, x: fn.linear(x, w[1:4, :]) @ w[:3, 1:3],  # two views, one element twice
    "reshape": lambda w, x: x @ w.reshape(4, 5),
    "conv-squeezed": lambda w, x: fn.conv1d(x.mT, w.reshape(5, 4, 1)).mT,
}
"""A parameter ``w`` (5 x 4) read through a view, on the right or the left of a product."""


@pytest.mark.parametrize("read", list(VIEWS))
def test_a_parameter_read_through_a_view_is_deferred(read: str) -> None:
    """A product whose weight is a view of a parameter that reads no element twice (a
    transpose, a reshape, a slice, taken on the right or the left) defers the parameter, with
    the fused backward's gradient; an expanded view (an element read twice) is a weight the
    graph computes, deferred through its graph (``test_wgrad_computed``)."""

    class Viewed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
            self.v = nn.Parameter(torch.randn(5, 1, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = VIEWS[read](self.w, x)
            return y[..., :2] @ self.v[:2].expand(2, 3)

    _defers_like_fused(Viewed(), torch.randn(2, 3, 4, dtype=torch.float64), {"w", "v"})


BATCHED = {
    "bmm": lambda e, x: torch.bmm(x, e),  # Llama 4's experts
    "bmm transposed": lambda e, x: torch.bmm(x, e.mT.mT),
    "matmul": lambda e, x: x @ e,
    "left": lambda e, x: (e.mT @ x.mT).mT,
    "broadcast": lambda e, x: x @ e[:1],  # one W for every entry: Zamba's W[:, None] @ x
    "einsum": lambda e, x: torch.einsum("bik,bkn->bin", x, e),
    "einsum left": lambda e, x: torch.einsum("bkn,tbk->tbn", e, x.transpose(0, 1)),
    "einsum shared": lambda e, x: torch.einsum("ibh,hnd->ibnd", x, e.reshape(4, 5, 2)),  # XLNet
}
"""One weight matrix per batch entry, ``e`` (2 x 4 x 5), times ``x`` (2 x 3 x 4)."""


@pytest.mark.parametrize("read", list(BATCHED))
def test_a_weight_per_batch_entry_is_deferred(read: str) -> None:
    """``bmm(x, E)`` with E a parameter of one matrix per batch entry (Llama 4's experts),
    on either side, broadcast over a batch dim, or in an ``einsum``: W computes dE."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Parameter(torch.randn(2, 4, 5, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return BATCHED[read](self.e, x)

    _defers_like_fused(Experts(), torch.randn(2, 3, 4, dtype=torch.float64), {"e"})


def test_a_product_of_an_input_without_a_graph_is_deferred() -> None:
    """A weight times a tensor that carries no graph (XLNet's and Funnel's relative positions,
    a buffer): the product's one gradient, the weight's, goes to W."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 5, dtype=torch.float64))
            self.r = nn.Parameter(torch.randn(4, 2, 5, dtype=torch.float64))
            self.register_buffer("pos", torch.randn(3, 4, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            r = torch.einsum("tk,knd->tnd", self.pos, self.r).sum(1)
            return x @ self.w + r + torch.mm(self.pos, self.w)

    _defers_like_fused(Positions(), torch.randn(2, 3, 4, dtype=torch.float64), {"w", "r"})


def _defers_like_fused(module: nn.Module, x: torch.Tensor, deferred: set[str]) -> None:
    """Traced by torch.fx and split: B leaves exactly the ``deferred`` parameters without a
    gradient, and W gives every parameter the fused backward's gradient."""
    x.requires_grad_(True)
    mod = (torch.fx.symbolic_trace(module))
    mod(x).square().sum().backward()
    params = dict(mod.named_parameters())
    want = [p.grad.clone() for p in params.values()]
    for p in params.values():
        p.grad = None
    work = WeightWork()
    with recording(work):
        out = mod(x)
    with work.backward_input():
        out.square().sum().backward()
    assert {n for n, p in params.items() if p.grad is None} == deferred
    assert set(work.deferred) == {id(params[n]) for n in deferred}
    work.run()
    assert _worst([p.grad for p in params.values()], want) <= RTOL


class SamePadded(nn.Module):
    """Convolutions padded by name, as EfficientNet's: exported as ``aten.conv2d.padding``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, (3, 4), padding="same")  # an odd total: one more at the end
        self.b = nn.Parameter(torch.randn(4, 4, 3, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fn.conv2d(self.a(x), self.b, padding="valid", dilation=(1, 2))


def test_convolutions_padded_by_name_are_deferred_in_an_exported_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 9, dtype=torch.float64, requires_grad=True)
    mod = torch.export.export(SamePadded().double(), (x,)).module()
    mod(x).square().sum().backward()
    params = dict(mod.named_parameters())
    want = [p.grad.clone() for p in params.values()]
    for p in params.values():
        p.grad = None
    work = WeightWork()
    with recording(work):
        out = mod(x)
    with work.backward_input():
        out.square().sum().backward()
    assert all(p.grad is None for p in params.values())
    assert set(work.deferred) == {id(p) for p in params.values()}
    work.run()
    assert _worst([p.grad for p in params.values()], want) <= RTOL


def test_hugging_face_conv1d_layers_are_split_where_not_traced() -> None:
    """GPT-2's own ``Conv1D`` (weight stored (in, out)) run as a layer, outside any graph:
    split by its class name, with the gradients of a fused backward."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(4, 6), Conv1D(5, 6)).double()
    ref = copy.deepcopy(mod)
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    ref(x).sum().backward()
    work = WeightWork()
    with recording(work):
        out = mod(x)
    with work.backward_input():
        out.sum().backward()
    assert mod[1].weight.grad is None and len(work.pending) == 2
    work.run()
    assert _worst([p.grad for p in mod.parameters()], [p.grad for p in ref.parameters()]) \
        <= RTOL
