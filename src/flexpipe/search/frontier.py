"""The memory/time frontier by construction: ``frontier`` searches a list of memory limits in
ascending order and seeds each search with the winner at the limit below it. A schedule whose
peak fits a smaller limit fits every larger one, and a seed is ranked like any candidate, so
the answer's objective (makespan, or span for ``objective="span"``) never rises with the
limit, at every p -- also where the memory ladder of a single search (``search.ladder``, p <=
``LADDER_MAX_P``) does not run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.ir.schedule import Schedule
from flexpipe.search.engine import search
from flexpipe.search.result import SearchResult


def frontier(cost: CostModel | None, p: int, m: int, limits: Sequence[float],
             **kw: Any) -> dict[float, SearchResult]:
    """``search(cost, p, m, limit, **kw)`` at every limit (each one number for every rank),
    smallest first, each seeded with the previous limit's best (``search(seeds=...)``):
    limit -> result, in ascending order of limit."""
    if "seeds" in kw:
        raise ConfigError("frontier() seeds each search itself; pass no seeds")
    out: dict[float, SearchResult] = {}
    seeds: list[Schedule] = []
    for limit in sorted(set(limits)):
        result = search(cost, p, m, limit, seeds=seeds, **kw)
        out[limit] = result
        if result.best is not None:
            seeds = [result.best]
    return out
