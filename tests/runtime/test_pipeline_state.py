"""A ``Pipeline``'s state under the user's own names, saved and resumed through
torch.distributed.checkpoint at another rank count: a CNN with BatchNorm and a long residual
(traced by torch.fx; its running statistics are buffers) and a tiny Hugging Face GPT-2 with tied
input and output embeddings (exported; the tie spans the first and the last rank) train 2 Adam
steps at p = 2 under 1F1B and are saved (``pipe.save(path, opt)``); a new process group at p = 4
(other stages on every rank) under ZB-H1 loads them (``pipe.load(path, opt)``) and trains one
more step. Parameters, buffers (running mean and variance, the batch count) and the optimizer's
effect equal an uninterrupted one-process run of 3 steps over the same micro-batches (float64,
relative error <= 1e-9). ``state_dict`` names every tensor as the model does, a tied weight
once; ``load_state_dict`` takes the whole model's state and refuses a wrong one by name. The
save runs in the shared 2-process launch and the resume in the shared 4-process launch
(``shared_launch``), which starts the 2-process one first when it comes first."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import shared_launch
import torch
import user_models as um
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.errors import ConfigError

RTOL = 1e-9
M = 4
STEPS_BEFORE, STEPS = 2, 3


class BNNet(nn.Module):
    """A small CNN: a stem, three conv + BatchNorm blocks and a head reading stem + blocks
    (a residual from the first stage to the last)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Conv2d(4, 4, 3, padding=1),
                                                    nn.BatchNorm2d(4), nn.ReLU())
                                      for _ in range(3)))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head((self.blocks(h) + h).mean(dim=(2, 3)))  # type: ignore[no-any-return]


def bnnet() -> nn.Module:
    return BNNet().double()


def images(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(n, 3, 6, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=gen))


def gpt2_tied() -> nn.Module:
    """A 4-layer GPT-2 (hidden 16, dropout 0) whose output head is its input embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=um.VOCAB, n_positions=2 * um.SEQ, n_embd=16, n_layer=4,
                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=True)
    return um.LogitsOf(GPT2LMHeadModel(cfg)).double()


H = "lm.transformer.h."
# name -> (build, data, loss, split points at p = 2, at p = 4)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], Callable[..., Any],
                        tuple[str, ...], tuple[str, ...]]] = {
    "bn": (bnnet, images, fn.cross_entropy, ("blocks.1",), ("blocks.0", "blocks.1", "blocks.2")),
    "gpt2": (gpt2_tied, um.tokens, um.lm_loss, (H + "2",), (H + "1", H + "2", H + "3")),
}


def _pipe(name: str, schedule: str, points: tuple[str, ...]) -> tuple[Any, Any]:
    build, data, loss, _, _ = MODELS[name]
    torch.manual_seed(0)
    pipe = flexpipe.pipeline(build(), schedule, loss_fn=loss, m=M, split_points=points,
                             example=data(0, 2)[0])
    return pipe, torch.optim.Adam(pipe.parameters(), lr=1e-2)


def _train(pipe: Any, opt: torch.optim.Optimizer, name: str, step: int) -> None:
    x, y = MODELS[name][1](step, 2 * M)
    opt.zero_grad()
    pipe.step(x if pipe.needs_inputs else None, y if pipe.needs_targets else None)
    opt.step()


def _copy(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in sd.items()}


def save_main(names: list[str], root: str) -> dict[str, Any]:
    """At p = 2 (1F1B): 2 steps of each model, then its checkpoint; this rank's state, and what
    loading a checkpoint that does not exist says."""
    out: dict[str, Any] = {}
    for name in names:
        pipe, opt = _pipe(name, "1f1b", MODELS[name][3])
        for step in range(STEPS_BEFORE):
            _train(pipe, opt, name, step)
        pipe.save(f"{root}/{name}", opt)
        out[name] = _copy(pipe.state_dict())
    try:
        pipe.load(f"{root}/none", opt)
        out[":missing"] = "accepted"
    except ConfigError as exc:
        out[":missing"] = str(exc)
    return out


def resume_main(names: list[str], root: str) -> dict[str, Any]:
    """At p = 4 (ZB-H1): each model loaded from its checkpoint and trained one more step; this
    rank's state, and what ``load_state_dict`` does with a whole model's ``state_dict`` (a tied
    weight under both its names) and with a wrong one."""
    out: dict[str, Any] = {}
    for name in names:
        pipe, opt = _pipe(name, "zb-h1", MODELS[name][4])
        pipe.load(f"{root}/{name}", opt)
        for step in range(STEPS_BEFORE, STEPS):
            _train(pipe, opt, name, step)
        out[name] = _copy(pipe.state_dict())
        out[name + ":buffers"] = sorted(n for n, _ in pipe.named_buffers())
        torch.manual_seed(0)
        fresh = MODELS[name][0]().state_dict()
        missing, unexpected = pipe.load_state_dict(fresh)
        back = pipe.state_dict()
        out[name + ":reload"] = (missing, unexpected,
                                 max(_rel(back[k], fresh[k]) for k in back))
        try:
            pipe.load_state_dict({"no.such.weight": torch.zeros(1)})
            out[name + ":bad"] = "accepted"
        except ConfigError as exc:
            out[name + ":bad"] = str(exc)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


@cache
def reference(name: str, steps: int) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """One process, no pipeline: the same micro-batches in order (BatchNorm sees each on its
    own, as every stage does), loss / m each, Adam after each batch."""
    build, data, loss, _, _ = MODELS[name]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = data(step, 2 * M)
        opt.zero_grad()
        for xj, yj in zip(x.chunk(M), y.chunk(M), strict=True):
            (loss(model(xj), yj) / M).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, model


def _names(model: nn.Module) -> set[str]:
    """What a pipeline's state dicts name: parameters (a tied one once), persistent buffers."""
    kept = model.state_dict()
    return {n for n, _ in model.named_parameters()} | \
        {n for n, _ in model.named_buffers() if n in kept}


def _union(ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every rank's state in one dict; a name on several ranks must hold the same values."""
    out: dict[str, torch.Tensor] = {}
    for sd in ranks:
        for k, v in sd.items():
            assert k not in out or torch.equal(out[k], v), k
            out[k] = v
    return out


def _models() -> list[str]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ["bn"]
    return list(MODELS)


pytestmark = pytest.mark.timeout(shared_launch.TIMEOUT_S)
ROOT: list[str] = []
"""The folder the checkpoints go to (made when the shared 2-process launch starts, removed
when the test process ends)."""


def _save_part() -> shared_launch.Part:
    ROOT.append(shared_launch.folder("flexpipe-state-"))
    return save_main, (_models(), ROOT[-1])


def _nothing() -> None:
    """The resume part when the save part's launch failed (the tests raise its error)."""


def _resume_part() -> shared_launch.Part:
    """The resume reads what the save wrote: the 2-process launch runs first."""
    try:
        shared_launch.results(2, "pipeline-state")
    except Exception:  # noqa: BLE001 - the fixture raises it; the other 4-rank parts go on
        return _nothing, ()
    return resume_main, (_models(), ROOT[-1])


shared_launch.register(2, "pipeline-state", _save_part)
shared_launch.register(4, "pipeline-state", _resume_part)


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    """The p = 2 part (train, save) and the p = 4 part (load, train) of the shared launches:
    each rank's result."""
    names = _models()
    saved = shared_launch.results(2, "pipeline-state")
    resumed = shared_launch.results(4, "pipeline-state")
    full = {n: _union([r[n] for r in saved]) for n in names}
    return {"names": names, "saved": saved, "full": full, "resumed": resumed}


def test_state_dict_names_every_tensor_as_the_model_does(runs: dict[str, Any]) -> None:
    for name in runs["names"]:
        want, model = reference(name, STEPS_BEFORE)
        got = runs["full"][name]
        assert set(got) == _names(model), set(got) ^ _names(model)
        worst = max(_rel(got[k], want[k]) for k in got)
        assert worst <= RTOL, (name, worst)
    bn = [set(r["bn:buffers"]) for r in runs["resumed"]]
    assert "stem.1.running_mean" in bn[0] and "blocks.2.1.num_batches_tracked" in bn[3]
    assert not bn[0] & bn[3]  # each rank names only its own stages' buffers
    if "gpt2" in runs["names"]:
        tied = "lm.transformer.wte.weight"
        first, last = runs["saved"][0]["gpt2"], runs["saved"][1]["gpt2"]
        assert tied in first and tied in last  # the tie spans both ranks, once on each
        assert "lm.lm_head.weight" not in first | last


def test_checkpoint_at_two_ranks_resumes_at_four_exactly(runs: dict[str, Any]) -> None:
    for name in runs["names"]:
        want, model = reference(name, STEPS)
        got = _union([r[name] for r in runs["resumed"]])
        assert set(got) == _names(model)
        errs = {k: _rel(got[k], want[k]) for k in got}
        assert max(errs.values()) <= RTOL, (name, sorted(errs.items(), key=lambda e: -e[1])[:3])
        # the third step moved every parameter: loading the checkpoint alone would not pass
        before = runs["full"][name]
        assert all(not torch.equal(got[n], before[n]) for n, _ in model.named_parameters())


def test_load_state_dict_takes_the_whole_model_and_refuses_a_wrong_one(
        runs: dict[str, Any]) -> None:
    if "gpt2" in runs["names"]:  # the whole model's state_dict names the tied weight twice
        assert {"lm.lm_head.weight", "lm.transformer.wte.weight"} <= set(gpt2_tied().state_dict())
    for name in runs["names"]:
        for r in runs["resumed"]:
            missing, unexpected, err = r[name + ":reload"]
            assert (missing, unexpected) == ([], []) and err == 0.0
            bad = r[name + ":bad"]
            assert "load_state_dict: missing on this rank:" in bad, bad
            assert "not in the model: no.such.weight" in bad, bad


def test_a_missing_checkpoint_is_refused_on_every_rank(runs: dict[str, Any]) -> None:
    said = [r[":missing"] for r in runs["saved"]]
    assert said[0] == said[1]
    assert said[0].startswith("Pipeline.load of ") and "rank 0: no checkpoint at" in said[0]
    assert "rank 1: no checkpoint at" in said[0]


def test_reference_moves_buffers() -> None:
    """The reference itself updates the running statistics (so the buffer check can fail)."""
    want, _ = reference("bn", 1)
    assert not torch.equal(want["stem.1.running_mean"], torch.zeros(4))
    assert int(want["stem.1.num_batches_tracked"]) == M
