"""A monotone memory/time frontier above p = 8: the memory ladder of one search now runs up to
p = 16 (``search.ladder``), and ``search.frontier`` seeds each limit's search with the winner
below it at any p, so more memory never gives a worse answer."""

from __future__ import annotations

import pytest

from flexpipe.cost import CostModel
from flexpipe.errors import ConfigError
from flexpipe.search import frontier, search
from flexpipe.search.ladder import LADDER_MAX_P
from flexpipe.search.space import VBLOCKS_MAX_P

ZB15 = {"f": 18.522, "b": 18.086, "w": 9.337, "act": 1.0, "wact": 0.5, "comm": 0.601}


def _objective(result: object) -> float:
    best = getattr(result, "best_trial", None)
    return float("inf") if best is None else float(best.span)


def test_the_ladder_runs_wherever_v_blocks_does() -> None:
    """The ladder covers every p the building-block scheduler is a candidate at."""
    assert LADDER_MAX_P == VBLOCKS_MAX_P == 16


def test_one_search_per_limit_is_monotone_at_p_10() -> None:
    """p = 10 (above the old ladder cap of 8), unit costs: separate searches, each with its own
    ladder, from below V-Half's memory to 1F1B's, never worse with more memory."""
    p, m = 10, 10
    results = [search(None, p, m, limit, objective="span") for limit in (6.0, 8.0, 10.0)]
    spans = [_objective(r) for r in results]
    assert all(b <= a + 1e-9 for a, b in zip(spans, spans[1:], strict=False)), spans
    assert any("@mem=" in t.label for t in results[-1].trials)  # the ladder ran


@pytest.mark.parametrize("cost", [pytest.param(None, marks=pytest.mark.slow), ZB15],
                         ids=["unit", "1.5B"])
def test_frontier_is_monotone_above_p_16(cost: dict[str, float] | None) -> None:
    """p = 18 (no ladder, no v-blocks): each limit's search seeded with the winner below. CI
    runs the paper's 1.5B times (F, B and W apart); unit times are ``slow``."""
    p, m = 18, 18
    model = None if cost is None else CostModel.uniform(p, p, **cost)
    found = frontier(model, p, m, [18.0, 10.0, 13.0, 27.0], objective="span")
    assert list(found) == [10.0, 13.0, 18.0, 27.0]
    spans = [_objective(r) for r in found.values()]
    assert all(b <= a + 1e-9 for a, b in zip(spans, spans[1:], strict=False)), spans
    seeds = [t for r in found.values() for t in r.trials if t.family == "seed"]
    assert len(seeds) == 3 and all(t.status in ("best", "slower") for t in seeds)


def test_seeds_must_match_and_rank_like_candidates() -> None:
    """A seed for other p or m is refused by name; a fitting seed can be the answer."""
    small = search(None, 4, 8, 4.0)
    assert small.best is not None
    with pytest.raises(ConfigError, match="seed"):
        search(None, 4, 6, 4.0, seeds=[small.best])
    again = search(None, 4, 8, 4.0, seeds=[small.best])
    assert again.best_trial is not None and again.best_trial.makespan is not None
    assert again.best_trial.makespan <= small.best_trial.makespan + 1e-9
    with pytest.raises(ConfigError, match="seeds"):
        frontier(None, 4, 8, [4.0], seeds=[small.best])
