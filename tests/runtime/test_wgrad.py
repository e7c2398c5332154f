"""The backward split (``flexpipe.runtime.execution.wgrad``), one process: for every layer type
it splits, B then W gives exactly the gradients of one fused backward; after B only W's (input,
output gradient) pairs are held, and W frees them and builds no graph; parameters it does not
know get their gradient in B; a recompute replays its forward's random numbers; seeded layers
draw the same masks in any grouping."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flexpipe.runtime.execution.activations import ActivationMeter
from flexpipe.runtime.execution.rng import Draw, Snapshot, drawing
from flexpipe.runtime.execution.stage import StageModule
from flexpipe.runtime.models.gpt import Block, GPTConfig
from flexpipe.runtime.split import WeightWork, recording


class Scale(nn.Module):
    """A layer the split does not know: its parameter is used in a plain multiply."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


class Bag(nn.Module):
    """A summing ``nn.EmbeddingBag`` over flat ids with offsets and per-sample weights."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 6, mode="sum")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.flatten()
        offsets = torch.tensor([0, 2, 7, 11])
        return self.bag(flat, offsets, per_sample_weights=torch.linspace(0.5, 1.5, len(flat)))


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` with both masks (or none), as a layer; with ``weights`` the
    attention weights it returns (averaged over heads or not) feed the output too."""

    def __init__(self, weights: bool = False, average: bool = True, masks: bool = True
                 ) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, dropout=0.2, batch_first=True)
        self.weights, self.average, self.masks = weights, average, masks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = torch.zeros(x.shape[0], x.shape[1], dtype=torch.bool)
        pad[0, -1] = True
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        masks = {"key_padding_mask": pad, "attn_mask": causal} if self.masks else {}
        out, weights = self.mha(x, x, x, need_weights=self.weights,
                                average_attn_weights=self.average, **masks)
        if weights is None:
            return out
        return out + (weights if self.average else weights.mean(1)) @ x


def _cases() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    return {
        "linear": (nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 4, bias=False)),
                   torch.randn(3, 5, 8)),
        "conv1d": (nn.Conv1d(3, 4, 3, stride=2), torch.randn(2, 3, 9)),
        "conv2d reflect": (nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"),
                           torch.randn(2, 3, 6, 6)),
        "conv3d groups": (nn.Conv3d(4, 4, 2, groups=2), torch.randn(1, 4, 3, 3, 3)),
        "conv2d same, odd total": (nn.Conv2d(3, 4, (3, 4), padding="same"),
                                   torch.randn(2, 3, 5, 7)),
        "conv2d same reflect dilated": (nn.Conv2d(3, 4, 3, padding="same", dilation=2,
                                                  padding_mode="reflect"),
                                        torch.randn(2, 3, 7, 7)),
        "conv1d valid": (nn.Conv1d(3, 4, 3, padding="valid", dilation=2), torch.randn(2, 3, 9)),
        "conv transpose2d": (nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1,
                                                groups=1), torch.randn(2, 4, 5, 5)),
        "conv transpose1d groups dilated": (nn.ConvTranspose1d(4, 6, 3, stride=2, groups=2,
                                                               dilation=2, bias=False),
                                            torch.randn(2, 4, 7)),
        "conv transpose3d": (nn.ConvTranspose3d(2, 3, 2, stride=2), torch.randn(1, 2, 3, 3, 3)),
        "embedding": (nn.Embedding(10, 6, padding_idx=0), torch.randint(0, 10, (3, 5))),
        "embedding bag mean": (nn.EmbeddingBag(10, 6, padding_idx=0),
                               torch.randint(0, 10, (3, 5))),
        "embedding bag max": (nn.EmbeddingBag(10, 6, mode="max"), torch.randint(0, 10, (3, 5))),
        "embedding bag sum weighted": (Bag(), torch.randint(0, 10, (3, 5))),
        "attention masks dropout": (SelfAttention(), torch.randn(2, 5, 16)),
        "attention weights masks dropout": (SelfAttention(weights=True), torch.randn(2, 5, 16)),
        "attention weights per head": (SelfAttention(weights=True, average=False, masks=False),
                                       torch.randn(2, 5, 16)),
        "encoder layer dropout": (nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1),
                                  torch.randn(5, 2, 16)),
        "gpt block": (Block(GPTConfig(hidden=16, heads=2, seq=8, dropout=0.1)),
                      torch.randn(2, 8, 16)),
        "unknown layer": (nn.Sequential(nn.Linear(8, 8), Scale(8)), torch.randn(4, 8)),
    }


def _fused(mod: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor | None:
    xi = x.clone().requires_grad_(x.is_floating_point())
    torch.manual_seed(1)
    mod(xi).backward(g)
    return xi.grad


@pytest.mark.parametrize("name", list(_cases()))
def test_split_gradients_equal_one_fused_backward(name: str) -> None:
    module, x = _cases()[name]
    ref, split = copy.deepcopy(module), (copy.deepcopy(module))
    torch.manual_seed(1)
    g = torch.randn_like(ref(x.clone()).float())
    dx_ref = _fused(ref, x, g)
    xi = x.clone().requires_grad_(x.is_floating_point())
    work = WeightWork()
    torch.manual_seed(1)
    with recording(work):
        out = split(xi)
    params = [p for p in split.parameters() if p.requires_grad]
    with work.backward_input():
        torch.autograd.backward([out], [g], inputs=([xi] if xi.requires_grad else []) + params)
    deferred = set(work.deferred)
    for p in split.parameters():  # B left exactly the deferred weights without gradient
        assert (p.grad is None) == (id(p) in deferred), name
    assert len(work.pending) > 0
    work.run()
    assert not work.pending and not work.held
    if dx_ref is not None:
        assert torch.allclose(xi.grad, dx_ref, rtol=1e-5, atol=1e-6), name
    for (pname, p), q in zip(split.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), (name, pname)


def test_split_micro_batches_accumulate_like_autograd() -> None:
    """Three micro-batches split into B and W add into the gradients as three fused backwards
    do."""
    module, _ = _cases()["gpt block"]
    ref, split = copy.deepcopy(module), (copy.deepcopy(module))
    ref.eval(), split.eval()  # no dropout: the two runs see the same arithmetic
    xs = [torch.randn(2, 8, 16) for _ in range(3)]
    gs = [torch.randn(2, 8, 16) for _ in range(3)]
    for x, g in zip(xs, gs, strict=True):
        ref(x).backward(g)
    params = [p for p in split.parameters() if p.requires_grad]
    for x, g in zip(xs, gs, strict=True):
        work = WeightWork()
        with recording(work):
            out = split(x.clone().requires_grad_())
        with work.backward_input():
            torch.autograd.backward([out], [g], inputs=params)
        work.run()
    for (name, p), q in zip(split.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name


def test_a_fused_backward_through_split_layers_computes_everything_at_once() -> None:
    module, x = _cases()["gpt block"]
    ref, split = copy.deepcopy(module), (copy.deepcopy(module))
    g = torch.randn(2, 8, 16)
    _fused(ref, x, g)
    work = WeightWork()
    torch.manual_seed(1)
    with recording(work):
        out = split(x)
    out.backward(g)  # not inside work.backward_input(): nothing deferred
    assert not work.pending
    for p, q in zip(split.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_after_b_only_each_weights_input_and_output_gradient_is_held() -> None:
    h, b, s = 32, 2, 16
    stage = (StageModule([Block(GPTConfig(hidden=h, heads=2, seq=s))] * 1, 1))
    sbh = b * s * h * 4
    x = torch.randn(b, s, h).requires_grad_()
    meter, work = ActivationMeter(stage.parameters()), WeightWork()
    with recording(work), meter.saving():
        (out,) = stage(x)
    meter.record(out, *work.kept)
    m_b = meter.live()
    with work.backward_input():
        torch.autograd.backward([out], [torch.ones_like(out)],
                                inputs=[x, *stage.parameters()])
    del out, x
    meter.record(*work.held)
    m_w = meter.live()
    # qkv: in 1 + grad 3; proj 1 + 1; up 1 + 4; down 4 + 1 (in units of sbh floats)
    assert m_w == 16 * sbh
    assert m_b > m_w
    work.run()
    assert meter.live() == 0


def test_w_leaves_plain_gradients_and_frees_what_b_held() -> None:
    """A convolution's weight gradient reads the weight itself: W builds no graph, so a second
    micro-batch's accumulation keeps neither a graph on ``param.grad`` nor B's tensors."""
    conv = (nn.Conv2d(3, 4, 3, padding=1))
    meter = ActivationMeter(conv.parameters())
    for _ in range(2):
        work = WeightWork()
        with recording(work):
            out = conv(torch.randn(2, 3, 6, 6).requires_grad_())
        with work.backward_input():
            torch.autograd.backward([out], [torch.ones_like(out)],
                                    inputs=[*conv.parameters()])
        del out
        meter.record(*work.held)
        assert meter.live() > 0
        work.run()
        assert meter.live() == 0
    for p in conv.parameters():
        assert p.grad is not None and p.grad.grad_fn is None and not p.grad.requires_grad


def test_a_recompute_replays_its_forwards_random_numbers() -> None:
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    snap = Snapshot.take(torch.device("cpu"))
    first = layer(x)
    after = torch.get_rng_state()
    with snap.replay():
        again = layer(x)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)  # the stream runs on as if not replayed


def test_seeded_layers_draw_the_same_masks_in_any_grouping() -> None:
    layers = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(4)]
    x = torch.randn(4, 8)
    with drawing(Draw(7, 3, 1)):
        whole = StageModule(layers, 0)(x)[0]
        torch.rand(5)  # other draws in between change nothing
        split = StageModule(layers[2:], 2)(*StageModule(layers[:2], 0)(x))[0]
    assert torch.equal(whole, split)
    with drawing(Draw(7, 3, 2)):
        other = StageModule(layers, 0)(x)[0]
    assert not torch.equal(whole, other)


def test_the_meter_holds_nothing_of_a_branch_that_feeds_nothing_after_backward() -> None:
    """An op that saves its own output (``exp``) on a branch the loss never reads (RWKV's
    unrolled loop leaves its last states so) is freed with the graph: the meter's saving
    hook keeps no cycle alive (it did, and RWKV's measured peaks read 13-17% over)."""
    from flexpipe.runtime.execution.activations import ActivationMeter

    w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    meter = ActivationMeter([w])
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    meter.data([x])  # the input, which this test holds
    with meter.saving():
        h = torch.exp(x @ w)
        dead = torch.exp(h * 2.0)  # feeds nothing
        loss = (h * h).sum()
    del dead
    assert meter.live() > 0
    loss.backward()
    del loss, h
    assert meter.live() == 0.0
