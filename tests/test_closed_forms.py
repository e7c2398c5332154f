"""Unit-cost bubble rates and peak activations of GPipe, 1F1B and ZB-H1 equal docs/facts.md's closed
forms for every p in 1..16 and m in 1..64, and the zero-bubble authors' published table."""

from __future__ import annotations

import pytest

from flexpipe.schedules.classic import gpipe, one_f_one_b
from flexpipe.schedules.zero_bubble import zb_h1, zb_h2
from flexpipe.sim import simulate

GRID = [(p, m) for p in range(1, 17) for m in range(1, 65)]


def _metrics(schedule):  # type: ignore[no-untyped-def]
    return simulate(schedule).metrics()


@pytest.mark.parametrize("p", range(1, 17))
def test_gpipe_and_1f1b_closed_forms(p: int) -> None:
    for m in range(1, 65):
        expected = (p - 1) / (m + p - 1)
        g, o = _metrics(gpipe(p, m)), _metrics(one_f_one_b(p, m))
        assert g.bubble_rate == pytest.approx(expected, abs=1e-12)
        assert o.bubble_rate == pytest.approx(expected, abs=1e-12)
        assert max(g.peak_activation) == m
        assert max(o.peak_activation) == min(p, m)
        assert o.peak_activation[0] == max(o.peak_activation)


@pytest.mark.parametrize("p", range(1, 17))
def test_zb_h1_closed_form(p: int) -> None:
    """(p-1)/(3m+p-1) for m >= p. For m < p rank 0 must wait for the first backward to come back
    (2p-1 units) before its m B and m W, so its span is 2m+2p-1: the exact bubble is
    1 - 3m/(2m+2p-1), which tests/test_brute_force.py confirms optimal on small cases."""
    for m in range(1, 65):
        z = _metrics(zb_h1(p, m))
        exact = (p - 1) / (3 * m + p - 1) if m >= p else 1 - 3 * m / (2 * m + 2 * p - 1)
        assert z.bubble_rate == pytest.approx(exact, abs=1e-12), (p, m)
        assert max(z.peak_activation) == min(p, m)


@pytest.mark.parametrize(("p", "m", "one_f_one_b_rate", "zb_h1_rate"), [
    (4, 12, 0.2000, 0.0769), (8, 24, 0.2258, 0.0886), (8, 64, 0.0986, 0.0352),
    (16, 48, 0.2381, 0.0943),
])
def test_zero_bubble_authors_table(p: int, m: int, one_f_one_b_rate: float,
                                   zb_h1_rate: float) -> None:
    assert _metrics(one_f_one_b(p, m)).bubble_rate == pytest.approx(one_f_one_b_rate, abs=5e-5)
    assert _metrics(zb_h1(p, m)).bubble_rate == pytest.approx(zb_h1_rate, abs=5e-5)
    h2 = _metrics(zb_h2(p, m))
    assert h2.bubble_rate == pytest.approx(0.0, abs=1e-12)
    assert max(h2.peak_activation) == 2 * p - 1


@pytest.mark.parametrize(("tf", "tb", "tw"), [(1.0, 1.0, 1.0), (2.0, 1.5, 0.5), (1.0, 2.0, 1.5)])
def test_general_times_bubble_sizes(tf: float, tb: float, tw: float) -> None:
    """Zero-bubble paper Table 2: bubble size (p-1)(T_F+T_B+T_W) for 1F1B, (p-1)(T_F+T_B-T_W)
    for ZB-H1 (when T_W <= T_F, T_B), (p-1)(T_F+T_B-2T_W) for ZB-H2."""
    from flexpipe.cost import CostModel

    p, m = 4, 16
    cost = CostModel.uniform(p, p, f=tf, b=tb, w=tw)
    work = m * (tf + tb + tw)
    spans = {name: max(simulate(fn(p, m), cost).metrics().span)
             for name, fn in (("1f1b", one_f_one_b), ("h1", zb_h1), ("h2", zb_h2))}
    assert spans["1f1b"] - work == pytest.approx((p - 1) * (tf + tb + tw))
    if tw <= min(tf, tb):
        assert spans["h1"] - work == pytest.approx((p - 1) * (tf + tb - tw))
        assert spans["h2"] - work == pytest.approx(max(0.0, (p - 1) * (tf + tb - 2 * tw)))
