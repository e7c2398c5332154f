"""Your own model through the public API (``flexpipe.pipeline``): a ViT-like model (patch
embedding, four ``nn.TransformerEncoderLayer``s, head) and an MLP with a skip connection over
stage boundaries, cut automatically (layer counts, counted FLOPs, parameters, or traced at split
points), trained with library schedules (1F1B, and the B/W-split ZB-H1 and ZB-V) at 2 gloo
ranks and at 4 (one pipeline of 4, and 2 ranks x 2 data-parallel replicas): loss, every
gradient, the parameters after 3 SGD steps and ``eval()`` outputs equal one device's. Inputs
are passed only where the first stage lives and targets only where the loss is. The shared
launch of each rank count (``shared_launch``) runs CI's cases in turn (each model once, each
schedule at least once); every other model x schedule pair is ``slow``. Bad input is refused
with a message naming it."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest
import shared_launch
import torch
import user_models as um
from torch import nn
from torch.nn import functional as fn

import flexpipe
from flexpipe.cost.partition import balanced_partition
from flexpipe.errors import ConfigError
from flexpipe.runtime.execution.segments import (
    Segment,
    build_graph_stages,
    build_stages,
    plan_stages,
    run_graph,
)
from flexpipe.runtime.measurement.balance import auto_partition, layer_params, split_layers
from flexpipe.runtime.measurement.compare import by_name, worst_relative_error
from flexpipe.runtime.measurement.profile import to_cost_model
from flexpipe.runtime.measurement.shares import deferred_shares
from flexpipe.runtime.measurement.sizes import edge_bytes, in_edges, stage_memory
from flexpipe.runtime.models.spec import ModelSpec
from flexpipe.runtime.processes.launch import check_job, launch, run_jobs
from flexpipe.runtime.processes.reference import reference_run
from flexpipe.runtime.processes.train import Job, TrainConfig
from flexpipe.runtime.user.tracing import split_points
from flexpipe.schedules import registry

RTOL = 1e-9
M = 4
BUILD: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any], Callable[..., Any]]] = {
    "vit-seq": (um.vit_sequential, um.images, fn.cross_entropy),
    "vit": (lambda: um.ViT().double(), um.images, fn.cross_entropy),
    "skip": (lambda: um.SkipNet().double(), um.vectors, fn.cross_entropy),
    "routed": (lambda: um.RoutedNet().double(), um.vectors, fn.cross_entropy),
    "normed": (lambda: um.NormedNet().double(), um.vectors, fn.cross_entropy),
    "recurrent": (lambda: um.RecurrentNet().double(), um.vectors, fn.cross_entropy),
    "gpt2": (um.gpt2, um.tokens, um.lm_loss),
    "tv-vit": (um.torchvision_vit, um.images, fn.cross_entropy),
}
# (model, schedule, pipeline keywords, dp)
CASES_2 = [
    ("vit-seq", "zb-h1", {"partition": "flops"}, 1),
    ("vit", "1f1b", {}, 1),  # no split points: balanced ones found automatically
    ("skip", "zb-v", {"split_points": ("mid.0", "mid.1", "mid.2")}, 1),
    ("routed", "zb-h1", {"split_points": ("mid.1",)}, 1),
    ("normed", "zb-v", {"split_points": ("mid.0", "mid.1", "mid.2")}, 1),
    ("recurrent", "zb-h1", {"split_points": ("lstm",)}, 1),
]
"""In CI: every model of ``BUILD`` once, each schedule and each way of cutting (counted FLOPs,
split points, none) at least once."""
LAYER = "lm.transformer.h."
TV_LAYER = "encoder.layers.encoder_layer_"
CASES_HF = [("gpt2", "zb-v", {"split_points": (LAYER + "1", LAYER + "2", LAYER + "3")}, 1)]
CASES_TV = [("tv-vit", "zb-v",
             {"split_points": (TV_LAYER + "1", TV_LAYER + "2", TV_LAYER + "3")}, 1)]
SLOW_2 = [
    ("vit-seq", "1f1b", {}, 1),
    ("vit-seq", "zb-v", {"partition": "params"}, 1),
    ("vit", "zb-v", {"split_points": ("blocks.0", "blocks.2", "head")}, 1),
    ("skip", "1f1b", {"split_points": ("mid.1",)}, 1),
    ("skip", "zb-h1", {"split_points": ("mid.1",)}, 1),
    ("routed", "zb-v", {"split_points": ("mid.0", "mid.1", "mid.2")}, 1),
    ("normed", "zb-h1", {"split_points": ("mid.1",)}, 1),
    ("recurrent", "zb-v", {"split_points": ("gru", "lstm", "out")}, 1),
]
SLOW_HF = [("gpt2", "1f1b", {"split_points": (LAYER + "2",)}, 1),
           ("gpt2", "zb-h1", {"split_points": (LAYER + "2",)}, 1)]
SLOW_TV = [("tv-vit", "1f1b", {"split_points": (TV_LAYER + "2",)}, 1),
           ("tv-vit", "zb-h1", {"split_points": (TV_LAYER + "2",)}, 1)]
"""The other cases of each model under each schedule (``slow``, in a 2-rank launch of their
own)."""
CASES_4 = [
    ("skip", "zb-h1", {"split_points": ("mid.0", "mid.1", "mid.2")}, 1),
    ("skip", "1f1b", {"split_points": ("mid.1",)}, 2),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def train_case(model_name: str, schedule: str, kw: dict[str, Any], dp: int) -> dict[str, float]:
    """On one rank: 3 pipelined SGD steps of the model next to the same training on one
    device (this process); the worst relative errors of loss, gradients, parameters, eval."""
    build, data, loss_fn = BUILD[model_name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    # one micro-batch: FLOPs are counted on it, a model torch.fx cannot trace is exported on it
    kw = {**kw, "example": data(0, 2)[0]}
    pipe = flexpipe.pipeline(model, schedule, loss_fn=loss_fn, m=M, dp=dp, **kw)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    errs = {"loss": 0.0, "grad": 0.0, "param": 0.0, "eval": 0.0}
    for step in range(3):
        x, y = data(step, 2 * M * dp)  # the global batch; this replica takes its share
        mine_x, mine_y = x.chunk(dp)[pipe.replica], y.chunk(dp)[pipe.replica]
        opt.zero_grad()
        loss = pipe.step(mine_x if pipe.needs_inputs else None,
                         mine_y if pipe.needs_targets else None)
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        if loss is not None:
            with torch.no_grad():
                want = loss_fn(ref(mine_x), mine_y)
            errs["loss"] = max(errs["loss"], _rel(loss, want))
        grads = dict(ref.named_parameters())
        errs["grad"] = max([errs["grad"]] + [_rel(p.grad, grads[n].grad)
                                             for n, p in pipe.named_parameters()])
        opt.step()
        ref_opt.step()
    params = dict(ref.named_parameters())
    errs["param"] = max(_rel(p, params[n]) for n, p in pipe.named_parameters())
    out = pipe.eval(mine_x if pipe.needs_inputs else None)
    if out is not None:
        ref.eval()
        with torch.no_grad():
            errs["eval"] = _rel(out, ref(mine_x))
    return errs


def bad_inputs() -> list[str]:
    """On one rank of 2: what each kind of bad input says (as a ConfigError)."""
    torch.manual_seed(0)
    pipe = flexpipe.pipeline(um.SkipNet().double(), "1f1b", loss_fn=fn.cross_entropy, m=M,
                             split_points=("mid.1",))
    x, y = um.vectors(0, 2 * M)
    said = []
    tries = [
        lambda: pipe.step(x, y),  # both given on both ranks: each is wrong on one of them
        lambda: pipe.step(x[:6] if pipe.needs_inputs else None,
                          y[:6] if pipe.needs_targets else None),
        lambda: pipe.step(None, None),
    ]
    for attempt in tries:
        try:
            attempt()
            said.append("accepted")
        except ConfigError as exc:
            said.append(str(exc))
    return said


def rank_main(cases: list[tuple[str, str, dict[str, Any], int]], errors: bool,
              jobs: tuple[Job, ...] = ()) -> list[Any]:
    """Every case in turn on this rank, then the ``jobs`` (as ``launch`` runs them) and the
    bad-input checks (with ``errors``)."""
    import torch.distributed as dist

    out: list[Any] = [train_case(*case) for case in cases]
    if jobs:
        out.append(run_jobs(dist.get_rank(), dist.get_world_size(), jobs))
    if errors:
        out.append(bad_inputs())
    return out


def _check(results: list[list[Any]], cases: list[Any]) -> None:
    for i, case in enumerate(cases):
        worst = {k: max(r[i][k] for r in results) for k in results[0][i]}
        assert all(v <= RTOL for v in worst.values()), (case, worst)


TRAIN = TrainConfig(steps=3, capture=True)


def _user_jobs() -> list[Job]:
    """The Job path (what ``flexpipe run --model user_models:vit_factory`` builds): a factory
    by name with the FLOPs-balanced partition, a UserModel object cut at a split point, and
    one cut where ``flexpipe.pipeline`` would cut it (no split points)."""
    by_factory = ModelSpec("user", micro_batch=2, factory="user_models:vit_factory")
    zbv = registry.build("zb-v", 2, M)
    torch.manual_seed(1)  # the fixture builds these again for the reference: same weights
    uncut = flexpipe.UserModel(um.SkipNet().double(), fn.cross_entropy, um.vectors(0, 2))
    return [Job(zbv, by_factory, TRAIN, auto_partition(by_factory, zbv.placement.stage_rank)),
            Job(registry.build("zb-h1", 2, M), um.skip_factory(), TRAIN),
            Job(zbv, uncut, TRAIN)]  # no split points: cut automatically


def _two_ranks_part() -> shared_launch.Part:
    """CASES_2, the Hugging Face cases (when transformers is installed), the torchvision cases
    (when torchvision is), the user jobs (checked as ``launch`` checks them) and the bad-input
    checks."""
    hf = CASES_HF if um.installed("transformers") else []
    tv = CASES_TV if um.installed("torchvision") else []
    jobs = _user_jobs()
    for job in jobs:
        check_job(job, 2)
    return rank_main, (CASES_2 + hf + tv, True, tuple(jobs))


shared_launch.register(2, "user-models", _two_ranks_part)
shared_launch.register(4, "user-models", lambda: (rank_main, (CASES_4, False)))


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, Any]:
    """The 2-rank part of the shared 2-rank launch (``_two_ranks_part``); every rank's results
    by part."""
    hf = CASES_HF if um.installed("transformers") else []
    jobs = _user_jobs()
    results = shared_launch.results(2, "user-models")
    n, k = len(CASES_2), len(CASES_2) + len(hf)
    return {"own": [r[:n] for r in results], "hf": [r[n:k] for r in results],
            "tv": [r[k:-2] for r in results], "said": [r[-1] for r in results],
            "jobs": (jobs, [[r[-2][j] for r in results] for j in range(len(jobs))])}


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_two_ranks_equal_one_device(two_ranks: dict[str, Any]) -> None:
    _check(two_ranks["own"], CASES_2)
    for rank, (both, short, none) in enumerate(two_ranks["said"]):
        wrong = "targets" if rank == 0 else "inputs"
        assert f"{wrong} given on rank {rank}, which does not hold the" in both
        assert "a batch of 6 samples cannot be cut into the schedule's 4 micro-batches" in short
        assert f"rank {rank} holds the" in none and "give the" in none


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_hugging_face_causal_lm_equals_one_device(two_ranks: dict[str, Any]) -> None:
    """A transformers GPT-2 (which torch.fx cannot trace: exported instead), cut at its
    decoder blocks, under ZB-V (1F1B and ZB-H1 in the ``slow`` run)."""
    pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")
    _check(two_ranks["hf"], CASES_HF)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_torchvision_vit_equals_one_device(two_ranks: dict[str, Any]) -> None:
    """torchvision's VisionTransformer (traced; its class token and position embedding are
    parameters outside the cut layers), cut at its encoder layers, under ZB-V (1F1B and ZB-H1
    in the ``slow`` run).
    torchvision is not in the ``dev`` extra: no wheel of it loads with the pinned CPU torch, so
    this runs where torchvision is installed."""
    pytest.importorskip("torchvision", reason="needs a torchvision built for this torch")
    _check(two_ranks["tv"], CASES_TV)


def test_ci_trains_every_model_under_every_schedule() -> None:
    """CI's cases cover every model and every schedule, and the slow ones repeat none."""
    ci = CASES_2 + CASES_HF + CASES_TV
    assert {case[0] for case in ci} == set(BUILD)
    assert {case[1] for case in ci} == {"1f1b", "zb-h1", "zb-v"}
    every = [repr(case) for case in ci + SLOW_2 + SLOW_HF + SLOW_TV]
    assert len(set(every)) == len(every)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_other_cases_equal_one_device() -> None:
    """``SLOW_2`` and the other Hugging Face and torchvision cases, in a launch of their own."""
    cases = SLOW_2 + (SLOW_HF if um.installed("transformers") else []) + \
        (SLOW_TV if um.installed("torchvision") else [])
    _check(flexpipe.spawn(rank_main, 2, cases, False, timeout_s=300, deadline_s=850),
           cases)


@pytest.mark.timeout(shared_launch.TIMEOUT_S)
def test_four_ranks_and_data_parallel() -> None:
    """CASES_4, in the shared 4-rank launch."""
    _check(shared_launch.results(4, "user-models"), CASES_4)


def test_skip_connection_becomes_a_stage_graph_edge() -> None:
    traced = split_points(um.SkipNet(), ("mid.0", "mid.1", "mid.2"))
    assert [seg.after for seg in traced.segments] == [(), ("s0",), ("s1",), ("s0", "s2")]


def test_each_edge_carries_what_its_consumer_reads() -> None:
    """Stage 0 computes ``h``, the mask and the table; only stage 1 reads ``h``, so the edges
    to stages 2 and 3 carry the mask and the table alone, and neither needs a gradient back."""
    traced = split_points(um.RoutedNet(), ("mid.0", "mid.1", "mid.2"))
    s0, s1, s2, s3 = traced.segments
    assert s1.after == ("s0",) and s1.grads is not None and s1.grads.count(True) == 1
    for seg in (s2, s3):
        assert seg.after[0] == "s0" and seg.takes is not None and seg.grads is not None
        from_s0 = len(seg.takes[0])
        assert from_s0 >= 1 and not any(seg.grads[:from_s0])  # no h, no gradient back
        assert all(seg.grads[from_s0:])  # the chain's own value
    stages = build_graph_stages(traced.segments, None, 4)
    assert set(stages[0].routes) == {1, 2, 3}
    assert not any(back for _, back in stages[0].routes[2] + stages[0].routes[3])
    x = torch.randn(2, 6)
    out = stages[0](x)
    assert sum(t.numel() for t in stages[0].handed(2, out)) < sum(t.numel() for t in out)
    # what the profile puts in the cost model: the bytes each edge carries, each way
    whole = sum(t.nbytes for t in out)
    to_1, to_2 = edge_bytes(stages[0], 1, out), edge_bytes(stages[0], 2, out)
    assert to_1[0] == whole and 0 < to_1[1] < whole  # h's gradient comes back, not the mask's
    assert 0 < to_2[0] < whole and to_2[1] == 0
    sizes = dict.fromkeys(("F", "B", "W", "act", "wact", "input", "params"), 1.0)
    stage = sizes | {"out_bytes": float(whole)}
    cost = to_cost_model([{"stages": dict.fromkeys(range(4), stage), "links": {},
                           "edges": {(0, 2): to_2}}], 4)
    assert cost.sent(0, 2) == to_2[0] and cost.sent(0, 2, grad=True) == 0


def test_the_profile_measures_what_a_consumer_keeps_of_its_input() -> None:
    """A stage whose first layer is a linear one keeps its whole input for its backward (and
    W: still held after B); one that starts with a tanh keeps its own output, not its input."""
    x = torch.randn(4, 6)
    for first, kept in ((nn.Linear(8, 8), True), (nn.Tanh(), False)):
        layers = (nn.Linear(6, 8), first, nn.Linear(8, 3))
        stages = build_stages(layers, (1, 2), 2)
        graph = plan_stages([Segment("", layers)], (1, 2), 2).graph
        with torch.no_grad():
            ins, outs = run_graph(stages, graph, (x,))
        sizes = stage_memory(stages[1], ins[1], None, False)
        data, grad, held, held_w = in_edges(stages, graph, 1, outs, sizes)[0]
        assert data == grad == 4 * 8 * 4 and held == held_w == (data if kept else 0.0)


def test_deferred_shares_count_what_w_computes() -> None:
    """Every weight of RoutedNet is an nn.Linear's (W computes all of it); a gain used in a
    plain product keeps its gradient in B and counts against its stage."""

    class Gained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(6, 4), nn.Linear(4, 3)
            self.gain = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x) * self.gain)

    x = torch.randn(2, 6)
    routed = split_points(um.RoutedNet(), ("mid.0", "mid.1", "mid.2")).segments
    assert deferred_shares(routed, (x,), 4) == [1.0, 1.0, 1.0, 1.0]
    got = deferred_shares(split_points(Gained(), ("b",)).segments, (x,), 2)
    assert got[0] == pytest.approx(28 / 32) and got[1] == 1.0  # a.weight, a.bias: 28 of 28 + gain 4
    normed = split_points(um.NormedNet(), ("mid.1",)).segments  # weights computed: all in W
    assert deferred_shares(normed, (x,), 2) == [1.0, 1.0]
    recurrent = split_points(um.RecurrentNet(), ("lstm",)).segments  # GRU, LSTM: all in W
    assert deferred_shares(recurrent, (x,), 2) == [1.0, 1.0]


def test_a_value_routed_without_its_gradient_is_refused() -> None:
    """Were the cut to misjudge a value that needs a gradient, the hand-over says so instead
    of dropping it."""
    stages = build_graph_stages(split_points(um.RoutedNet(), ("mid.1",)).segments, None, 2)
    route = stages[0].routes[1]
    stages[0].routes[1] = tuple((i, False) for i, _ in route)
    outs = stages[0](torch.randn(2, 6))
    with pytest.raises(ConfigError, match="needs a gradient, but stage 1 was cut to return none"):
        stages[0].handed(1, outs)


def test_split_by_parameters_balances_the_ranks() -> None:
    layers = list(um.vit_sequential())
    stage_rank = registry.build("zb-v", 2, 4).placement.stage_rank
    got = split_layers(layers, "params", stage_rank)
    assert got == balanced_partition(layer_params(layers), stage_rank) and sum(got) == 6
    assert split_layers(layers, "layers", (0, 1, 2)) == [2, 2, 2]
    with pytest.raises(ConfigError, match="give example inputs"):
        split_layers(layers, "flops", stage_rank)
    with pytest.raises(ConfigError, match=r"partition \[1, 1\] must give each of the 4"):
        split_layers(layers, (1, 1), stage_rank)


def test_automatic_split_points_balance_the_ranks_parameters() -> None:
    """Without split points, the cut minimises the busiest rank's parameters over every
    module start (checked against all single cuts of the ViT)."""
    from flexpipe.runtime.user.autocut import auto_points

    vit = um.ViT()
    size = {n: sum(p.numel() for p in m.parameters()) for n, m in vit.named_children()}
    block = size["blocks"] // 4
    loads = [size["embed"] + k * block for k in range(1, 4)]
    best = min(range(3), key=lambda k: max(loads[k], size["embed"] + 4 * block + size["head"]
                                           - loads[k]))
    assert auto_points(vit, (0, 1)) == (f"blocks.{best + 1}",)
    assert auto_points(um.SkipNet(), (0, 1, 2)) == ("mid.1", "mid.2")


class Embedded(nn.Module):
    """An embedding (many parameters, no FLOPs), linear layers of uneven widths and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4096, 16)
        widths = [16, 16, 64, 64, 16]
        self.layers = nn.ModuleList(nn.Linear(a, b)
                                    for a, b in zip(widths, widths[1:], strict=False))
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


def test_automatic_split_points_balance_the_ranks_flops_given_an_example() -> None:
    """With example inputs the cut balances counted FLOPs (brute force over every single cut
    and every V of three cuts), not parameters: the embedding's 65k parameters compute
    nothing."""
    from torch.utils.flop_counter import FlopCounterMode

    from flexpipe.runtime.user.autocut import auto_points

    model, ids = Embedded(), torch.randint(0, 4096, (2, 8))
    units = [model.emb, *model.layers, model.head]
    names = ["emb", "layers.0", "layers.1", "layers.2", "layers.3", "head"]
    flops, h = [], ids
    for unit in units:
        with FlopCounterMode(display=False) as counter:
            h = unit(h)
        flops.append(counter.get_total_flops())

    def worst(cuts: tuple[int, ...], ranks: tuple[int, ...]) -> float:
        bounds, loads = (0, *cuts, len(units)), [0.0] * (max(ranks) + 1)
        for s, r in enumerate(ranks):
            loads[r] += sum(flops[bounds[s]:bounds[s + 1]])
        return max(loads)

    for ranks in ((0, 1), (0, 1, 1, 0)):
        cuts = combinations(range(1, len(units)), len(ranks) - 1)
        best = min(worst(c, ranks) for c in cuts)
        got = auto_points(model, ranks, (ids,))
        assert worst(tuple(names.index(p) for p in got), ranks) == best, (ranks, got)
    assert auto_points(model, (0, 1)) == ("layers.0",)  # parameters: the embedding alone
    assert auto_points(model, (0, 1), (ids,)) != ("layers.0",)


def test_choosing_split_points_leaves_the_model_as_it_was() -> None:
    """Counting FLOPs runs the model once: a BatchNorm's batch count and running statistics
    and torch's random state are as before."""
    from flexpipe.runtime.user.autocut import auto_points

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.5),
                          nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x).mean()

    x, net = torch.randn(2, 3, 8, 8), Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.get_rng_state()
    assert auto_points(net, (0, 1), (x,))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(state, torch.get_rng_state())


class MLPBlock(nn.Module):
    """A residual MLP block: its hidden layer is 4x as wide as the residual."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


def test_automatic_split_points_never_send_a_blocks_wide_hidden_layer() -> None:
    """Three blocks on two ranks balance best between a block's two products; the cut falls on
    a block's start instead, where only the residual crosses."""
    from flexpipe.runtime.user.autocut import auto_points

    model = nn.Sequential(nn.Linear(8, 8), *(MLPBlock() for _ in range(3)))
    x = torch.randn(4, 8)

    class Wrapped(nn.Module):  # not a chain: traced and cut at module starts
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x).sum(-1)

    for ranks in ((0, 1), (0, 1, 1, 0), (0, 1, 2)):
        got = auto_points(Wrapped(), ranks, (x,))
        assert all(p.count(".") == 1 for p in got), (ranks, got)  # net.K, never net.K.fc2


def test_automatic_split_points_of_an_exported_model_fall_on_block_starts() -> None:
    """A Hugging Face GPT-2 (exported on the example; torch.fx cannot trace it): where cuts
    cost the same, the cut moves to the outermost module there (a block's start, where one
    tensor crosses, not a dropout ending the block before)."""
    pytest.importorskip("transformers")
    from flexpipe.runtime.user.autocut import auto_points

    ids = um.tokens(0, 2)[0]
    got = auto_points(um.gpt2(), (0, 1, 1, 0), (ids,))
    assert len(got) == 3 and not any("dropout" in p for p in got), got
    assert all(p.startswith("lm.transformer.h.") for p in got), got
    with pytest.raises(ConfigError, match="give example inputs"):
        auto_points(um.gpt2(), (0, 1))


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return self.lin(x)
        return x


def test_bad_models_are_refused_clearly() -> None:
    with pytest.raises(ConfigError, match="cannot trace Branchy with torch.fx"):
        split_points(Branchy(), ("lin",))
    with pytest.raises(ConfigError, match="split point 'mid.7' is not a module the model's "
                       "forward calls .*inp, mid.0, mid.1"):
        split_points(um.SkipNet(), ("mid.7",))
    with pytest.raises(ConfigError, match="are not in the order the forward runs them"):
        split_points(um.SkipNet(), ("mid.2", "mid.0"))
    with pytest.raises(ConfigError, match="Job\\(schedule, model\\) got a bare list"):
        Job(registry.build("1f1b", 2, 4), list(um.vit_sequential()))
    with pytest.raises(ConfigError, match="cannot trace Branchy with torch.fx"):
        Job(registry.build("1f1b", 2, 4), flexpipe.UserModel(Branchy(), fn.cross_entropy))


def test_a_job_cuts_a_model_without_split_points_as_pipeline_does() -> None:
    """``Job`` (and ``flexpipe run --model``) cuts your own model where ``flexpipe.pipeline``
    would: the automatic split points for its schedule's placement."""
    from flexpipe.runtime.user.autocut import auto_points

    x, y = um.vectors(0, 2)
    for name, p in (("1f1b", 2), ("zb-v", 2), ("1f1b", 3)):
        sched = registry.build(name, p, 4)
        job = Job(sched, flexpipe.UserModel(um.SkipNet().double(), fn.cross_entropy, (x, y)))
        assert job.model.cut == auto_points(um.SkipNet().double(), sched.placement.stage_rank,
                                            x)
        assert len(job.model.cut) == sched.num_stages - 1


def test_job_and_factory_train_a_user_model_like_one_device(two_ranks: dict[str, Any]) -> None:
    """The Job path (``_user_jobs``), in the 2-rank launch."""
    jobs, results = two_ranks["jobs"]
    assert len(results) == len(jobs) == 3 and all(len(ranks) == 2 for ranks in results)
    for job, ranks in zip(jobs, results, strict=True):
        ref = reference_run(job.model, TRAIN, M)
        losses = [r.losses for r in ranks if r.losses[0] is not None]
        assert losses and losses[0] == pytest.approx(ref.losses, rel=RTOL)
        for what, want in (("grads", ref.grads), ("params", ref.params)):
            name, err = worst_relative_error(by_name(ranks, what), want)
            assert err <= RTOL, (job.model.factory, what, name, err)


def test_the_example_runs_under_torchrun() -> None:
    script = Path(__file__).parents[2] / "examples" / "train_my_model.py"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    losses = [float(line.split()[-1]) for line in run.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0], run.stdout
    assert "accuracy on the last batch" in run.stdout


def test_a_model_without_split_points_trains_as_one_stage() -> None:
    """No split points: the model is traced whole, one stage on one rank, and ZB-H1's B/W
    split on it trains like one device."""
    train = TrainConfig(steps=2, capture=True)
    job = Job(registry.build("zb-h1", 1, M),
              flexpipe.UserModel(um.SkipNet().double(), fn.cross_entropy, um.vectors(0, 2)),
              train)
    ranks = launch([job], 1)[0]
    ref = reference_run(job.model, train, M)
    assert ranks[0].losses == pytest.approx(ref.losses, rel=RTOL)
    for what, want in (("grads", ref.grads), ("params", ref.params)):
        name, err = worst_relative_error(by_name(ranks, what), want)
        assert err <= RTOL, (what, name, err)


class SharedBlock(nn.Module):
    """One block (a linear layer, a residual and a norm) of ``SharedEncoder``."""

    def __init__(self) -> None:
        super().__init__()
        self.ff, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h + torch.relu(self.ff(h)))  # type: ignore[no-any-return]


class SharedEncoder(nn.Module):
    """ALBERT's shape: a small embedding, one block applied 12 times, a pooler, a dropout and
    a head, so that the model's own children hold nearly all the work in one of them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layer = nn.Linear(6, 16), SharedBlock()
        self.pooler, self.drop, self.head = nn.Linear(16, 16), nn.Dropout(0.0), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for _ in range(12):
            h = self.layer(h)
        return self.head(self.drop(torch.tanh(self.pooler(h))))  # type: ignore[no-any-return]


def test_an_automatic_cut_leaves_no_rank_idle() -> None:
    """At the model's own children the best cut gives a rank only the embedding (3 ranks) or a
    stage only the dropout (a V); the cut moves into the shared block's first call instead,
    where every rank gets work (``autocut.IDLE``)."""
    from flexpipe.runtime.user.autocut import auto_points

    x = torch.randn(2, 6)
    assert auto_points(SharedEncoder(), (0, 1, 2), (x,)) == ("layer.norm", "pooler")
    assert auto_points(SharedEncoder(), (0, 1, 1, 0), (x,)) == ("layer", "layer.norm", "pooler")
