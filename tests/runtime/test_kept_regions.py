"""What a trace could miss, kept or refused by name (``flexpipe.runtime.user.regions`` and
``modes``), at 2 gloo ranks (the shared 2-process launch) against the model itself:

- custom ``torch.autograd.Function``s (a scaled gradient, a hand-written linear on a block's
  own weight, a leaky straight-through clamp) run their own backward in the stages: the
  gradients of 1F1B, ZB-H1 and ZB-V equal the model's in float64;
- ``torch.autocast`` regions (in a submodule, a decorated forward, a float32 island, a region
  over the whole forward that spans every split point; traced by torch.fx or exported)
  compute as in the model under 1F1B and interleaved 1F1B: float32 gradients within 1e-5 of
  its own (dropping autocast is 1e-3 off); a B/W-split schedule is refused when built;
- a forward reading ``self.training`` (stochastic depth, train-only noise and head) trains like
  the one-process pipeline and evaluates like ``model.eval()``;
- a step under ``torch.autocast`` is refused on both ranks before any message, and the
  pipeline then still trains.

In this process: an exported model applying a Function, and a model whose eval-mode stages
would pass other values, are refused naming what and where (a ``torch.library`` custom op with
its autograd, the way round, is exported whole and keeps its backward); a stage that writes
into its input runs again on copies without printing anything, while another failure keeps
torch.fx's report."""

from __future__ import annotations

from typing import Any

import kept_models as km
import pytest
import shared_launch
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.user.tracing import split_points

M = 4
MODELS: dict[str, Any] = {
    "functions": (lambda: km.FunctionNet().double(), torch.float64),
    "autocast": (lambda: km.AutocastNet(), torch.float32),
    "autocast-whole": (lambda: km.AutocastNet(whole=True), torch.float32),
    "autocast-export": (lambda: km.AutocastNet(branch=True), torch.float32),
}
CASES = [
    ("functions", "1f1b", ("blocks.1",)), ("functions", "zb-h1", ("blocks.1",)),
    ("functions", "zb-v", ("blocks.0", "blocks.1", "blocks.2")),
    ("autocast", "1f1b", ("deco",)), ("autocast-whole", "1f1b", ("amp.b",)),
    ("autocast-whole", "interleaved-1f1b", ("amp", "deco", "mid")),
    ("autocast-export", "1f1b", ("head",)),
]
TRAINING = [("zb-h1", ("blocks.1",)), ("zb-v", ("blocks.0", "blocks.1", "blocks.2"))]


def _data(dtype: torch.dtype, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11 + step)
    return (torch.randn(2 * M, 6, generator=gen).to(dtype),
            torch.randint(0, 3, (2 * M,), generator=gen))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()  # type: ignore[no-any-return]


def grads_main(name: str, schedule: str, points: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """This rank's gradients after one step."""
    x, y = _data(MODELS[name][1])
    pipe = flexpipe.pipeline(_model(name), schedule, loss_fn=fn.cross_entropy, m=M,
                             split_points=points, example=x[:2])
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    return {n: p.grad.detach().clone() for n, p in pipe.named_parameters()}


def training_main(schedule: str, points: tuple[str, ...]) -> dict[str, Any]:
    """3 seeded steps of the training-branch model, then its parameters and eval output."""
    torch.manual_seed(0)
    pipe = flexpipe.pipeline(km.TrainingNet().double(), schedule, loss_fn=fn.cross_entropy,
                             m=M, split_points=points, seed=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(3):
        x, y = _data(torch.float64, step)
        opt.zero_grad()
        pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
        opt.step()
    x, _ = _data(torch.float64, 9)
    return {"params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
            "eval": pipe.eval(x if pipe.needs_inputs else None)}


def autocast_main() -> dict[str, Any]:
    """What a step under torch.autocast says on this rank; then a plain step's loss."""
    x, y = _data(torch.float32)
    pipe = flexpipe.pipeline(_model("autocast"), "1f1b", loss_fn=fn.cross_entropy, m=M,
                             split_points=("deco",))
    args = (x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pipe.step(*args)
        said = "accepted"
    except ConfigError as exc:
        said = str(exc)
    loss = pipe.step(*args)
    try:
        flexpipe.pipeline(_model("autocast-export"), "zb-h1", loss_fn=fn.cross_entropy, m=M,
                          split_points=("head",), example=x[:2])
        split = "accepted"
    except ConfigError as exc:
        split = str(exc)
    return {"said": said, "after": None if loss is None else float(loss), "split": split}


def main() -> dict[str, Any]:
    return {"grads": [grads_main(*case) for case in CASES],
            "training": [training_main(*case) for case in TRAINING],
            "autocast": autocast_main()}


shared_launch.register(2, "kept-regions", lambda: (main, ()))
shared_launch.register(1, "kept-regions", lambda: (training_main, ("1f1b", ())))


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return shared_launch.results(2, "kept-regions")


def _reference(name: str) -> dict[str, torch.Tensor]:
    """The model's own gradients over the same micro-batches."""
    model = _model(name)
    x, y = _data(MODELS[name][1])
    for xj, yj in zip(x.chunk(M), y.chunk(M), strict=True):
        (fn.cross_entropy(model(xj), yj) / M).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(want)
    return max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_functions_and_autocast_regions_train_like_the_model(
        ranks: list[dict[str, Any]]) -> None:
    for i, (name, schedule, points) in enumerate(CASES):
        got = {n: g for r in ranks for n, g in r["grads"][i].items()}
        tol = 1e-10 if MODELS[name][1] == torch.float64 else 1e-5
        assert _worst(got, _reference(name)) <= tol, (name, schedule, points)


def test_dropping_autocast_would_be_seen() -> None:
    """The tolerance above tells autocast kept from autocast dropped: the blocks' float32
    result is more than 1e-4 off their autocast one."""
    model = _model("autocast")
    x, _ = _data(torch.float32)
    half = model.amp
    with torch.no_grad():
        h = model.stem(x)
        kept = model.deco(half(h)).float()
        plain = torch.tanh(model.deco.a(half.b(torch.relu(half.a(h)).softmax(-1) * 8)))
    assert float((kept - plain).abs().max()) > 1e-4


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_training_branch_trains_and_evaluates_like_the_model(
        ranks: list[dict[str, Any]]) -> None:
    ref = shared_launch.results(1, "kept-regions")[0]
    for i, case in enumerate(TRAINING):
        got = {n: p for r in ranks for n, p in r["training"][i]["params"].items()}
        assert _worst(got, ref["params"]) <= 1e-12, case
        out = next(r["training"][i]["eval"] for r in ranks if r["training"][i]["eval"] is not None)
        assert torch.allclose(out, ref["eval"], rtol=1e-12, atol=0.0), case
    model = km.TrainingNet().double()
    model.load_state_dict(ref["params"])
    x, _ = _data(torch.float64, 9)
    with torch.no_grad():
        assert torch.allclose(ref["eval"], model.eval()(x), rtol=1e-12, atol=0.0)
        assert not torch.allclose(ref["eval"], model.train()(x))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_a_step_under_autocast_is_refused_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert "called under torch.autocast (cpu, torch.bfloat16)" in r["autocast"]["said"]
        assert "inside the model's forward" in r["autocast"]["said"]
    assert any(r["autocast"]["after"] is not None for r in ranks)
    for r in ranks:  # and a B/W-split schedule for a model under autocast, when it is built
        assert "torch.autocast (a region in module" in r["autocast"]["split"]
        assert "use a schedule without a W pass" in r["autocast"]["split"]


def test_an_exported_function_is_refused_by_name() -> None:
    model = km.FunctionNet(branch=True).double()
    x = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(ConfigError, match=r"Function ScaleGrad in module '\(the model itself\)'"
                       r".*custom_op"):
        split_points(model, ["blocks.1"], x)


def test_a_split_point_inside_an_exported_autocast_region_is_refused() -> None:
    x = torch.randn(2, 6)
    with pytest.raises(ConfigError, match=r"'amp.b' is not a module .* torch.export keeps "
                       "each torch.autocast region as one operation"):
        split_points(km.AutocastNet(branch=True), ["amp.b"], x)


class Boundary(nn.Module):
    """A train-only auxiliary value computed before the split point and used after it."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.aux = nn.Linear(4, 4), nn.Linear(4, 4)
        self.blocks = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        extra = self.aux(h) if self.training else None
        h = self.blocks(h)
        return h + extra if extra is not None else h


def test_eval_stages_passing_other_values_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"reads self.training in module 'aux'.*move the "):
        split_points(Boundary(), ["blocks.1"])
    with pytest.raises(ConfigError, match=r"'aux'; its eval-mode graph cannot be cut so: "
                       r"split point 'aux' is not a module"):
        split_points(Boundary(), ["aux"])  # a module only the training forward calls


class Outer(nn.Module):
    """A linear layer, then a block that writes into its input (``broken``: that fails)."""

    def __init__(self, broken: bool = False) -> None:
        super().__init__()
        self.pre, self.inner = nn.Linear(4, 4), Inner(broken)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))  # type: ignore[no-any-return]


class Inner(nn.Module):
    """Scales its input in place (``broken``: multiplies it by a matrix of the wrong shape)."""

    def __init__(self, broken: bool) -> None:
        super().__init__()
        self.a, self.broken = nn.Linear(4, 4), broken

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.broken:
            x = torch.mm(x, torch.ones(8, 8))
        else:
            x.mul_(2.0)
        return self.a(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("broken", [False, True])
def test_a_retry_on_copies_prints_nothing(capfd: pytest.CaptureFixture[str],
                                          broken: bool) -> None:
    torch.manual_seed(0)
    stages = [StageModule(seg.layers, 0) for seg in split_points(Outer(broken),
                                                                  ["inner"]).segments]
    (h,) = stages[0](torch.randn(4, 4))
    capfd.readouterr()
    if not broken:
        stages[1](h.detach().requires_grad_())
        assert stages[1].copies_inputs
        assert capfd.readouterr().err == ""
        return
    with pytest.raises(RuntimeError, match="shape"):
        stages[1](h.detach().requires_grad_())
    assert "Call using an FX-traced Module" in capfd.readouterr().err  # nothing lost


def test_a_custom_op_with_its_autograd_is_exported_whole() -> None:
    """The way round the refusal above: the gradient reversal as a torch.library custom op
    keeps its backward when exported and cut."""
    torch.manual_seed(0)
    model = km.FlipNet().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    first, second = (seg.layers[0] for seg in split_points(model, ["b"], x).segments)
    out0 = first(x)
    inner = tuple(t.detach().requires_grad_() for t in out0)
    second(*inner)[0].square().sum().backward()
    torch.autograd.backward(list(out0), [t.grad for t in inner])
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model(x).square().sum().backward()
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-12, atol=0.0), n
    assert float(model.a.weight.grad.norm()) > 0
