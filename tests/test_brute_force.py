"""Brute force on small cases: no per-rank order (F, B, W each in micro-batch order) within the
same activation memory (min(p, m) micro-batches) beats the library's ZB-H1 and 1F1B bubbles,
including ZB-H1 with fewer micro-batches than ranks."""

from __future__ import annotations

import itertools

import pytest

from flexpipe.errors import ValidationError
from flexpipe.ir import Op, Placement, Schedule
from flexpipe.schedules.zero_bubble import zb_h1
from flexpipe.sim import simulate


def _orders(stage: int, m: int, kinds: tuple[str, ...]) -> list[list[Op]]:
    """Every interleaving of the per-kind chains with F_j < B_j < W_j on one stage."""
    out: list[list[Op]] = []

    def rec(counts: list[int], seq: list[Op]) -> None:
        if all(c == m for c in counts):
            out.append(list(seq))
            return
        for k, name in enumerate(kinds):
            j = counts[k]
            if j < m and (k == 0 or counts[k - 1] > j):
                counts[k] += 1
                seq.append(Op(name, stage, j))
                rec(counts, seq)
                seq.pop()
                counts[k] -= 1

    rec([0] * len(kinds), [])
    return out


def _best_bubble(p: int, m: int, kinds: tuple[str, ...], mem: float) -> float:
    """Smallest bubble over every order whose peak activation stays within ``mem``."""
    best = 1.0
    per_rank = [_orders(r, m, kinds) for r in range(p)]
    for combo in itertools.product(*per_rank):
        try:
            trace = simulate(Schedule.build(combo, Placement.linear(p), m))
        except ValidationError:
            continue  # a deadlocking combination
        metrics = trace.metrics()
        if max(metrics.peak_activation) <= mem:
            best = min(best, metrics.bubble_rate)
    return best


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 2), (3, 1), (3, 2), (2, 3), (4, 1)])
def test_zb_h1_is_optimal_on_small_cases(p: int, m: int) -> None:
    ours = simulate(zb_h1(p, m)).metrics().bubble_rate
    assert ours == pytest.approx(_best_bubble(p, m, ("F", "B", "W"), min(p, m)), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 2), (3, 3)])
def test_1f1b_is_optimal_among_fused_orders(p: int, m: int) -> None:
    from flexpipe.schedules.classic import one_f_one_b

    ours = simulate(one_f_one_b(p, m)).metrics().bubble_rate
    assert ours == pytest.approx(_best_bubble(p, m, ("F", "BW"), min(p, m)), abs=1e-12)
