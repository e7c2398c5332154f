"""The B/W split beyond the matrix's models: every family of ``hf_families`` (decoder LMs of
the Llama and GPT lines, Falcon's ``x @ self.weight.T`` layers, mixtures of experts with a
shared expert, state-space models, encoders including ALBERT's one shared layer,
encoder-decoders with a frozen parameter, vision transformers and convolutional networks),
exported by torch.export and cut at its blocks.

In one process: B then W gives the fused backward's gradients (float64, 1e-9) and W computes
the gradient of >= 90% of every stage's weight elements (13 families in CI, all in the
``slow`` run). At 2 gloo ranks (the shared 2-process launch): six families train under
ZB-V like one device, and two cut by the automatic split points; in the ``slow`` run every
family does, under ZB-V and ZB-H1 at its blocks and under ZB-V cut automatically."""

from __future__ import annotations

from typing import Any

import pytest
import shared_launch

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")
import hf_families as hf  # noqa: E402 - needs transformers
import test_wgrad_models as wm  # noqa: E402

SAMPLE = ("falcon", "qwen2-moe", "albert", "swin", "mamba", "llama4")
"""Trained at 2 ranks in CI: a transposed weight, a shared expert, a shared layer, windowed
vision attention, a state-space model (weights read through views and on the left), experts
as one matrix each (``bmm``) with complex rotary tables crossing the stages."""
SPLIT = {"gemma", "falcon", "qwen2-moe", "albert", "bart", "mt5", "swin", "convnext", "mamba",
         "pegasus", "efficientnet", "llama4", "xlnet", "deepseek-v3", "wav2vec2"}
"""Split in CI: tied embeddings, a transposed weight, a shared expert, a shared layer, two
encoder-decoders, windowed attention, a ConvNet, a state-space model, a frozen parameter
(Pegasus's sinusoidal positions), convolutions padded "same", experts as ``bmm``, ``einsum``
projections, a weight cast before its product (DeepSeek-V3's router), a weight-normed
convolution (Wav2Vec2's positional one) (the rest in the ``slow`` run)."""


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in SPLIT else pytest.mark.slow)
                                  for n in hf.TABLE])
def test_split_backward_equals_fused_and_defers_the_weights(name: str) -> None:
    hf.register((name,))
    wm.test_split_backward_equals_fused_and_defers_the_weights(name)


AUTO = (("gpt2", "zb-v"), ("falcon", "zb-h1"))
"""Cut where ``flexpipe.pipeline`` chooses (no split points: the ranks' FLOPs balanced)."""


def _train(names: tuple[str, ...]) -> list[float]:
    hf.register(names + tuple(n for n, _ in AUTO if n in hf.TABLE))
    return [wm.train(name, "zb-v") for name in names] + \
        [wm.train(name, schedule, auto=True) for name, schedule in AUTO]


shared_launch.register(2, "hf-families", lambda: (_train, (SAMPLE,)))


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_one_family_of_each_kind_trains_under_zb_v_like_one_device() -> None:
    """And GPT-2 and Falcon without split points (cut where FLOPs balance)."""
    results: list[Any] = shared_launch.results(2, "hf-families")
    for i, name in enumerate(SAMPLE + tuple(n for n, _ in AUTO)):
        worst = max(r[i] for r in results)
        assert worst <= hf.rtol(name), (name, i >= len(SAMPLE), worst)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_family_trains_under_zb_v_and_zb_h1_like_one_device() -> None:
    import flexpipe

    names = tuple(hf.TABLE)
    per_rank = flexpipe.spawn(_train_both, 2, names, timeout_s=850)
    for r in per_rank:
        for (name, schedule), worst in r.items():
            assert worst <= hf.rtol(name), (name, schedule, worst)


def _train_both(names: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """Every family under ZB-V and ZB-H1 at its blocks, and under ZB-V cut automatically."""
    hf.register(names)
    out = {(n, s): wm.train(n, s) for n in names for s in ("zb-v", "zb-h1")}
    return out | {(n, "zb-v, cut automatically"): wm.train(n, "zb-v", auto=True)
                  for n in names}
