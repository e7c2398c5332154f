"""Balanced partitions (``flexpipe run --partition auto``): the busiest rank's work is minimal
(checked against brute force), V placements get uneven layer counts, layer work is counted the
same way every time, and bad input is refused by name."""

from __future__ import annotations

import random
from itertools import combinations

import pytest

from flexpipe.cli.main import main
from flexpipe.cost import partition
from flexpipe.cost.partition import balanced_partition
from flexpipe.errors import ConfigError
from flexpipe.ir.placement import Placement
from flexpipe.runtime.measurement.balance import auto_partition, layer_flops
from flexpipe.runtime.models.kinds import build_model, make_batch
from flexpipe.runtime.models.spec import ModelSpec


def _rank_max(counts: list[int], costs: list[float], stage_rank: tuple[int, ...]) -> float:
    loads = [0.0] * (max(stage_rank) + 1)
    start = 0
    for s, c in enumerate(counts):
        loads[stage_rank[s]] += sum(costs[start:start + c])
        start += c
    return max(loads)


def _brute(costs: list[float], stage_rank: tuple[int, ...]) -> float:
    n, k = len(costs), len(stage_rank)
    best = float("inf")
    for inner in combinations(range(1, n), k - 1):
        cuts = (0, *inner, n)
        counts = [cuts[i + 1] - cuts[i] for i in range(k)]
        best = min(best, _rank_max(counts, costs, stage_rank))
    return best


PLACEMENTS = [Placement.linear(2), Placement.linear(3), Placement.vshape(2),
              Placement.vshape(3), Placement.interleaved(2, 2)]


@pytest.mark.parametrize("seed", range(40))
def test_busiest_rank_matches_brute_force(seed: int) -> None:
    rnd = random.Random(seed)
    pl = rnd.choice(PLACEMENTS)
    costs = [rnd.choice([0.0, 0.3, 1.0, rnd.uniform(0, 3)]) for _ in range(
        rnd.randint(pl.num_stages, 11))]
    counts = balanced_partition(costs, pl.stage_rank)
    assert len(counts) == pl.num_stages and min(counts) >= 1 and sum(counts) == len(costs)
    assert _rank_max(counts, costs, pl.stage_rank) == pytest.approx(_brute(costs, pl.stage_rank))


@pytest.mark.parametrize("seed", range(10))
def test_large_case_local_search_beats_even_split(seed: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond the enumeration limit: valid, and never worse than even layer counts."""
    monkeypatch.setattr(partition, "EXACT_LIMIT", 0)
    rnd = random.Random(seed)
    pl = Placement.vshape(4)
    costs = [0.0] + [1.0] * rnd.randint(8, 30) + [rnd.uniform(0.2, 2.0)]
    counts = balanced_partition(costs, pl.stage_rank)
    n, k = len(costs), pl.num_stages
    even = [n // k + (1 if s < n % k else 0) for s in range(k)]
    assert min(counts) >= 1 and sum(counts) == n
    assert _rank_max(counts, costs, pl.stage_rank) <= _rank_max(even, costs, pl.stage_rank)


def test_v_placement_pairs_cheap_ends_with_more_blocks() -> None:
    """GPT on a V over 2 ranks: rank 0 holds the embedding and the head, so it gets more
    blocks than an even split gives it; the busiest rank carries 3 blocks + head, not 4."""
    costs = [0.0, 1, 1, 1, 1, 1, 1, 0.33]
    counts = balanced_partition(costs, Placement.vshape(2).stage_rank)
    assert _rank_max(counts, costs, Placement.vshape(2).stage_rank) == pytest.approx(3.33)
    assert _rank_max([2, 2, 2, 2], costs, Placement.vshape(2).stage_rank) == pytest.approx(4.0)


def test_layer_flops_are_counted_and_repeatable() -> None:
    spec = ModelSpec("gpt", layers=3, hidden=16, heads=2, vocab=32, seq=8, micro_batch=2)
    layers, _ = build_model(spec)
    inputs = make_batch(spec, 0, 1)[0][0]
    flops = layer_flops(layers, inputs)
    assert len(flops) == len(layers) and flops == layer_flops(layers, inputs)
    assert flops[1] == flops[2] == flops[3] > flops[-1] > 0  # identical blocks; a lighter head
    assert auto_partition(spec, Placement.vshape(2).stage_rank) == (2, 1, 1, 1)


def test_bad_input_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="fewer than the 4 stages"):
        balanced_partition([1.0, 1.0], Placement.vshape(2).stage_rank)
    with pytest.raises(ConfigError, match="chain models"):
        auto_partition(ModelSpec("clip", layers=2), Placement.linear(2).stage_rank)
    assert main(["run", "1f1b", "-p", "2", "--partition", "2,x"]) == 2
    assert "expected auto or positive layer counts" in capsys.readouterr().err
