"""A failure on one rank reaches every rank at once, as one error naming where it began, and the
pipeline runs the next call exactly: at 2 gloo ranks (1F1B, float64), a stage whose forward
raises on rank 0 at micro-batch 1, the sink stage raising on rank 1 at micro-batch 0, float64
inputs into a float32 model (rank 0), and a forward raising in ``eval`` (rank 1) each make
``step``/``eval`` raise the same ``RankError`` on both ranks, naming the rank, stage,
micro-batch, op and the exception. The ranks' receive timeout is 300 s and the launch's
deadline far below it, so a failure learnt by a timeout fails the test instead of passing
late. After each failure the next step's loss and gradients equal one device's (after zeroing
the gradients the failed step left), and the next eval's outputs equal the model's.

``save`` and ``load`` the same way: paths that differ between the ranks (rank 1's cannot be
written), an optimizer whose state raises on rank 1 while it is saved, and one whose
``load_state_dict`` raises on rank 1, are each one error on both ranks naming rank 1 and the
exception; the next save and load then work and give the saved values back."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import FlexPipeError

M = 2
TRAP: dict[str, int] = {}
"""This process's armed trap: ``at`` = the forward call (from 1) that raises."""


class Trap(nn.Module):
    """Identity, raising at its ``TRAP["at"]``-th call in this process while armed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "at" in TRAP:
            TRAP["calls"] = TRAP.get("calls", 0) + 1
            if TRAP["calls"] == TRAP["at"]:
                TRAP.clear()
                raise ValueError("the trap was sprung")
        return x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), Trap(), nn.Tanh(), nn.Linear(8, 3), Trap())


def _said(call: Any) -> str:
    try:
        call()
    except FlexPipeError as exc:
        recovered = getattr(exc, "recovered", None)
        return f"{type(exc).__name__} (recovered {recovered}): {exc}"
    return "returned"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def _exact(pipe: Any, ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """A good step after zeroing the gradients: its worst relative error against one device
    (loss where it is computed, every gradient of this rank)."""
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    ref.zero_grad()
    want = fn.cross_entropy(ref(x), y)
    want.backward()
    named = dict(ref.named_parameters())
    errors = [_rel(p.grad, named[n].grad) for n, p in pipe.named_parameters()]
    if loss is not None:
        errors.append(_rel(loss, want.detach()))
    return max(errors)


def failing_main() -> dict[str, Any]:
    """On one rank: each failure, what the call said and the exact step (or eval) after it."""
    model = _model().double()
    ref = copy.deepcopy(model)
    pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=M, timeout_s=300)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2 * M, 6, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (2 * M,), generator=gen)
    out: dict[str, Any] = {}

    def step(inputs: torch.Tensor) -> Any:
        return pipe.step(inputs if pipe.needs_inputs else None, y if pipe.needs_targets else None)

    for name, victim, at in (("first stage", 0, 2), ("sink stage", 1, 1)):
        if pipe.rank == victim:
            TRAP.update(at=at)
        out[name] = _said(lambda: step(x))
        out[name + ":next"] = _exact(pipe, ref, x, y)
    if pipe.rank == 1:
        TRAP.update(at=2)  # the second micro-batch's forward in eval
    out["eval"] = _said(lambda: pipe.eval(x if pipe.needs_inputs else None))
    got = pipe.eval(x if pipe.needs_inputs else None)
    out["eval:next"] = None if got is None else _rel(got, ref(x).detach())
    single = _model()  # float32: float64 inputs do not fit its layers
    ref32 = copy.deepcopy(single).double()
    pipe32 = flexpipe.pipeline(single, "1f1b", loss_fn=fn.cross_entropy, m=M, timeout_s=300)
    out["dtype"] = _said(lambda: pipe32.step(x if pipe32.needs_inputs else None,
                                             y if pipe32.needs_targets else None))
    out["dtype:next"] = _exact(pipe32, ref32.float(), x.float(), y)
    return out


class Jammed(dict):  # type: ignore[type-arg]
    """An optimizer's state whose reading raises (a failed disk, say)."""

    def get(self, *args: Any) -> Any:
        raise OSError("the optimizer's state cannot be read")


def _jammed_load(state: Any) -> None:
    raise KeyError("momentum_buffer")


def saving_main(folder: str) -> dict[str, Any]:
    """On one rank: each failing save or load, what it said; then a good save and load."""
    model = _model().double()
    pipe = flexpipe.pipeline(model, "1f1b", loss_fn=fn.cross_entropy, m=M, timeout_s=300)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    path = f"{folder}/ck"
    out = {"paths": _said(lambda: pipe.save(path if pipe.rank == 0 else "/proc/ck", opt))}
    saved = {n: t.clone() for n, t in pipe.state_dict().items()}
    if pipe.rank == 1:
        opt.state = Jammed()  # type: ignore[assignment]
    out["save"] = _said(lambda: pipe.save(path, opt))
    opt.state = __import__("collections").defaultdict(dict)  # type: ignore[assignment]
    out["save:next"] = _said(lambda: pipe.save(path, opt))
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    if pipe.rank == 1:
        opt.load_state_dict = _jammed_load  # type: ignore[method-assign]
    out["load"] = _said(lambda: pipe.load(path, opt))
    if pipe.rank == 1:
        del opt.load_state_dict
    out["load:next"] = _said(lambda: pipe.load(path, opt))
    out["load:equal"] = all(torch.equal(t, saved[n]) for n, t in pipe.state_dict().items())
    return out


def every_main(folder: str) -> dict[str, Any]:
    return {**failing_main(), **saving_main(folder)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # the deadline is far below the ranks' 300 s receive timeout: a failure learnt by a
    # timeout ends the launch (a LaunchError) instead of passing late
    folder = str(tmp_path_factory.mktemp("saves"))
    return flexpipe.spawn(every_main, 2, folder, timeout_s=60, deadline_s=150)


WHERE = {"first stage": "rank 0 in op 0F1 (F of stage 0, micro-batch 1): ValueError: the trap "
                        "was sprung",
         "sink stage": "rank 1 in op 1F0 (F of stage 1, micro-batch 0): ValueError: the trap "
                       "was sprung",
         "eval": "rank 1 in op 1F1 (F of stage 1, micro-batch 1): ValueError: the trap was "
                 "sprung",
         "dtype": "rank 0 in op 0F0 (F of stage 0, micro-batch 0): RuntimeError: mat1 and "
                  "mat2 must have the same dtype"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(WHERE))
def test_a_failure_on_one_rank_is_one_error_on_every_rank(results: list[dict[str, Any]],
                                                          case: str) -> None:
    said = [r[case] for r in results]
    assert said[0] == said[1], said  # the same error on both ranks
    call = "eval" if case == "eval" else "step"
    head = f"RankError (recovered True): Pipeline.{call} failed on {WHERE[case]}"
    assert said[0].startswith(head), said[0]
    assert "can run the next one" in said[0], said[0]
    if call == "step":  # the other rank waited for the failed one (its eval had ended)
        assert "stopped waiting for it" in said[0], said[0]
        assert "zero them before the next step" in said[0], said[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(WHERE))
def test_the_call_after_a_failure_is_exact(results: list[dict[str, Any]], case: str) -> None:
    errors = [r[case + ":next"] for r in results if r[case + ":next"] is not None]
    assert errors and max(errors) <= (1e-5 if case == "dtype" else 1e-12), results


SAVES = {"paths": "ConfigError: Pipeline.save to {path} refused on every rank: rank 0: the ranks "
                  "gave different paths (rank 0: {path}, rank 1: /proc/ck); every rank must "
                  "give the same one; rank 1: the ranks gave different paths",
         "save": "ConfigError: Pipeline.save to {path} refused on every rank: rank 1: OSError: "
                 "the optimizer's state cannot be read",
         "load": "RunError: Pipeline.load of {path} failed (every rank's parameters and buffers "
                 "are loaded, the optimizer's state not on the ranks named): rank 1: the "
                 "optimizer's state could not be loaded: KeyError: 'momentum_buffer'"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(SAVES))
def test_a_save_or_load_failing_on_one_rank_is_one_error_on_every_rank(
        results: list[dict[str, Any]], case: str) -> None:
    said = [r[case].replace(" (recovered None)", "") for r in results]
    tails = [text.split(" ", 4)[4] for text in said]  # each names its own path first
    assert tails[0] == tails[1], said
    path = said[0].split(" ")[3]
    assert said[0].startswith(SAVES[case].format(path=path)), said[0]


@pytest.mark.timeout(300)
def test_the_save_and_load_after_a_failure_work(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["save:next"] == r["load:next"] == "returned" and r["load:equal"], r
