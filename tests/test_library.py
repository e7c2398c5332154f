"""The schedule library: every schedule validates and simulates over a grid of p, m and its own
parameters; unit-cost numbers match docs/facts.md; impossible combinations get clear messages."""

from __future__ import annotations

import inspect
import math

import pytest

from flexpipe.cost import CostModel
from flexpipe.cost.model import Comm, StageCost
from flexpipe.errors import ConfigError
from flexpipe.ir.op import Op
from flexpipe.schedules import registry
from flexpipe.schedules.classic import interleaved_1f1b, one_f_one_b
from flexpipe.schedules.registry import build
from flexpipe.schedules.vshape import v_block, v_half, v_min, v_zb, v_zb_block
from flexpipe.schedules.zero_bubble import zb_v, zb_v_pattern
from flexpipe.sim import simulate
from flexpipe.sim.validate import validate
from flexpipe.specs import load

PS = range(1, 9)
WIDE_PS = range(9, 13)
SHORT_PS = {"v-half": range(1, 7)}
"""Families whose CI grid stops early (V-Half takes seconds per schedule from p = 7); the
``slow`` wide grid runs on from there."""


V_PS = [4, 6, 8, pytest.param(16, marks=pytest.mark.xdist_group("v-family-p16"))]
"""The V family's sizes against the paper; the tests at p = 16 build the same schedules
(remembered per process: ``schedules.memo``), so one worker runs them all and builds each once."""


def _ps(name: str) -> range:
    return SHORT_PS.get(name, PS)


def _wide_ps(name: str) -> range:
    return range(_ps(name).stop, WIDE_PS.stop)
MS = (1, 2, 3, 5, 7, 8, 12, 13, 24, 31, 48)
VARIANTS = {"v": (2, 3), "w": (1, 2), "U": (None, 1, 3), "selective": (False, True)}


def _variants(name: str) -> list[dict[str, object]]:
    params = [k for k, _ in registry.library()[name].params if k in VARIANTS]
    if not params:
        return [{}]
    return [{k: v} for k in params for v in VARIANTS[k]]


def _valid_over(name: str, ps: range) -> int:
    """Every variant of ``name`` at every p of ``ps`` and m of ``MS`` (thinned) validates and
    simulates; how many schedules were checked."""
    checked = 0
    for kw in _variants(name):
        for p in ps:
            for m in MS:
                if kw.get("v") == 3 or kw.get("w") == 2 or kw.get("U") == 3:
                    if (p + m) % 3:  # thin the extra variants to keep the suite fast
                        continue
                if m > 24 and p % 4 not in (0, 1):  # the long runs at p = 1, 4, 5, 8, 9, 12
                    continue
                if not registry.library()[name].builds(p, m):  # below its least m
                    continue
                sched = registry.build(name, p, m, **kw)
                assert validate(sched) == [], (name, p, m, kw)
                assert simulate(sched).metrics().makespan > 0
                checked += 1
    return checked


@pytest.mark.parametrize("name", registry.names())
def test_every_schedule_valid_over_grid(name: str) -> None:
    """p = 1 .. 8 (1 .. 6 for ``SHORT_PS``; odd and even, 3 | p and not, m below, at and above
    p, up to 48); a family defined from some m on (DualPipeV: m >= 2p) at every m of the grid
    from there, one defined at even p only (DualPipe) at those."""
    assert _valid_over(name, _ps(name)) >= _want(name, _ps(name))


def _want(name: str, ps: range) -> int:
    """The fewest schedules ``_valid_over`` must check: 9 of the grid's m per (p, m) the family
    is defined at, pro rata."""
    entry = registry.library()[name]
    return sum(1 for p in ps for m in MS if entry.builds(p, m)) * 9 // len(MS)


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names())
def test_every_schedule_valid_over_the_wide_grid(name: str) -> None:
    """p = 9 .. 12 (from 7 for ``SHORT_PS``): the same grid, where V-Half and V-Min take most
    of a minute to build."""
    wide = _wide_ps(name)
    assert _valid_over(name, wide) >= min(len(wide) * 9, _want(name, wide))


@pytest.mark.parametrize("name", registry.names())
def test_docstring_cites_source_and_numbers(name: str) -> None:
    doc = inspect.getdoc(registry.library()[name].fn) or ""
    assert len(doc) > 80 and any(ch.isdigit() for ch in doc), name


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("interleaved-1f1b", {"v": 0}, "v must be a positive integer"),
    ("hanayo", {"w": 0}, "w >= 1"),
    ("zeropp", {"U": 0}, "U >= 1"),
    ("1f1b", {"v": 2}, "takes no parameter v"),
    ("nope", {}, "unknown schedule"),
])
def test_impossible_combinations_are_refused(name: str, kwargs: dict[str, object],
                                             message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        registry.build(name, 4, 8, **kwargs)


def test_bad_p_and_m_are_refused() -> None:
    for p, m in ((0, 4), (4, 0), (-1, 3)):
        for name in registry.names():
            with pytest.raises(ConfigError):
                registry.build(name, p, m)


def _peak_ratio_and_bubble_ratio(fn, p: int, m: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    base = simulate(one_f_one_b(p, m)).metrics()
    got = simulate(fn(p, m)).metrics()
    return (max(got.peak_activation) / max(base.peak_activation),
            got.bubble_rate / base.bubble_rate)


@pytest.mark.parametrize("p", V_PS)
def test_v_family_memory_matches_paper(p: int) -> None:
    m = 3 * p
    assert max(simulate(v_min(p, m)).metrics().peak_activation) == (p + 4) // 3
    assert max(simulate(v_half(p, m)).metrics().peak_activation) <= (p + 2) // 2
    assert max(simulate(v_zb(p, m)).metrics().peak_activation) <= p
    assert max(simulate(zb_v(p, m)).metrics().peak_activation) <= p


@pytest.mark.parametrize("p", V_PS)
def test_v_family_bubbles_are_ordered_like_the_paper(p: int) -> None:
    m = 3 * p
    _, vmin = _peak_ratio_and_bubble_ratio(v_min, p, m)
    _, vhalf = _peak_ratio_and_bubble_ratio(v_half, p, m)
    _, vzb = _peak_ratio_and_bubble_ratio(v_zb, p, m)
    assert 0.55 <= vmin <= 0.8  # about 2/3 of 1F1B's bubble
    assert 0.3 <= vhalf <= 0.65  # about half (the authors' own: 0.32 at p = 4, 0.47 at 8)
    assert vzb <= 0.05 and vzb < vhalf < vmin  # near zero (docs/facts.md)


@pytest.mark.parametrize("p", V_PS)
def test_v_half_reaches_the_authors_adaptive_curve_at_unit_cost(p: int) -> None:
    """docs/facts.md: at V-Half's memory (p + 2 chunks) adaptive V leaves b = 3p - 7 chunk-pass
    slots, bubble rate b / (6m + b); the squeezed V-Half pattern reaches it exactly."""
    m, b = 3 * p, 3 * p - 7
    met = simulate(v_half(p, m)).metrics()
    assert met.bubble_rate == pytest.approx(b / (6 * m + b), abs=1e-12)
    assert max(met.peak_activation) <= (p + 2) // 2


def test_v_min_reaches_the_authors_pattern_at_p6() -> None:
    """The authors' V-Min pattern (interval 2 when 3 divides p), squeezed: 0.1360 at p = 6."""
    assert simulate(v_min(6, 18)).metrics().bubble_rate == pytest.approx(0.1360, abs=5e-5)


@pytest.mark.parametrize(("p", "m"), [(4, 12), (8, 24)])
def test_v_zb_is_near_zero_bubble_at_1f1b_memory(p: int, m: int) -> None:
    """docs/facts.md: V-ZB has 1F1B's memory and about zero bubble (unit costs)."""
    met = simulate(v_zb(p, m)).metrics()
    assert met.bubble_rate <= 0.02
    assert max(met.peak_activation) <= p


@pytest.mark.parametrize("p", [2, 3, 5, 8, 16])
def test_v_zb_block_is_zb_v_steady_state(p: int) -> None:
    """The V-ZB block tiles T (the rank's work) with each rank's down-chunk F, B, W then up-chunk
    F, B, W back to back, every pass after its inputs, W right behind its B."""
    block, cost = v_zb_block(p)
    T = block.interval
    assert T == pytest.approx(3.0)  # unit costs: six passes of 0.5 per rank
    for i in range(p):
        down, up = i, 2 * p - 1 - i
        phases = [block.offsets[Op(k, s, 0)] % T for s in (down, up) for k in "FBW"]
        assert phases == pytest.approx([(phases[0] + 0.5 * k) % T for k in range(6)])
    for s in range(2 * p):
        f, b, w = (block.offsets[Op(k, s, 0)] for k in "FBW")
        assert w == b + 0.5 and b >= f + 0.5
        if s > 0:
            assert f >= block.offsets[Op("F", s - 1, 0)] + 0.5
        if s < 2 * p - 1:
            assert b >= block.offsets[Op("B", s + 1, 0)] + 0.5


@pytest.mark.parametrize("p", V_PS)
def test_zb_v_is_zero_bubble_at_1f1b_memory(p: int) -> None:
    """docs/facts.md: ZB-V at T_F = T_B = T_W has zero bubble at 1F1B's peak (p M_B)."""
    for m in (2 * p, 3 * p):
        met = simulate(zb_v(p, m)).metrics()
        assert met.bubble_rate == pytest.approx(0.0, abs=1e-12), m
        assert max(met.peak_activation) == p


@pytest.mark.parametrize("p", [2, 4, 6, 8, 16])
def test_zb_v_pattern_is_zero_bubble_at_1f1b_memory(p: int) -> None:
    """The paper's fixed ZB-V order alone: zero bubble at unit times, peak p M_B."""
    for m in (2 * p, 3 * p + 1):
        met = simulate(zb_v_pattern(p, m)).metrics()
        assert met.bubble_rate == pytest.approx(0.0, abs=1e-12), m
        assert max(met.peak_activation) == p
    with pytest.raises(ConfigError, match="m >= 2p"):
        zb_v_pattern(p, 2 * p - 1)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_v_holds_up_when_pass_times_differ(p: int) -> None:
    """The default ZB-V (built at unit times) run at other T_F : T_B : T_W and with link
    latency stays within 2.5% of torch.distributed.pipelining's ZBV order (an independent
    implementation of the same paper schedule) and never worse than 8% above the work."""
    m = 3 * p
    ours, theirs = build("zb-v", p, m), load("torch:zbv", p, m)
    for f, b, w in ((1, 2, 1), (1, 1.3, 1), (1, 1.2, 1.5), (1, 0.8, 1.4)):
        cost = CostModel(tuple(StageCost({"F": f / 2, "B": b / 2, "W": w / 2})
                               for _ in range(2 * p)), Comm.uniform(p, latency=0.05))
        t_ours = simulate(ours, cost).metrics().makespan
        assert t_ours <= 1.025 * simulate(theirs, cost).metrics().makespan, (f, b, w)
        assert t_ours <= 1.08 * m * (f + b + w) + 2 * p * 0.05 * 2, (f, b, w)


@pytest.mark.parametrize("p", [4, 8])
def test_interleaved_bubble_about_p_minus_1_over_vm(p: int) -> None:
    for v in (2, 4):
        m = 2 * p
        rate = simulate(interleaved_1f1b(p, m, v)).metrics().bubble_rate
        # bubble time (p-1)/v per pass-triple against m units of work
        expected = ((p - 1) / v) / (m + (p - 1) / v)
        assert rate == pytest.approx(expected, rel=0.15)


@pytest.mark.parametrize("p", [4, 6, 8])
def test_v_half_steady_phase_is_bubble_free(p: int) -> None:
    """docs/facts.md: with T_W + 2T_B >= 2T_F and T_W + 2T_F >= 2T_B (T_F=1, T_B=1.5, T_W=0.8) the
    steady phase has no idle time on any rank, at half of 1F1B's memory."""
    m = 32
    from flexpipe.ir import Placement

    cost = CostModel.per_rank(Placement.vshape(p).stage_rank, p, f=1.0, b=1.5, w=0.8)
    trace = simulate(v_half(p, m, cost), cost)
    assert max(trace.metrics().peak_activation) <= (p + 2) // 2 + 1e-9
    linear = CostModel.per_rank(Placement.linear(p).stage_rank, p, f=1.0, b=1.5, w=0.8)
    base = simulate(one_f_one_b(p, m), linear).metrics().bubble_rate
    assert trace.metrics().bubble_rate < base
    for r in range(p):
        st, en = trace.starts[r], trace.ends[r]
        n = len(st)
        idle = sum(max(0.0, st[i + 1] - en[i]) for i in range(n // 3, 2 * n // 3))
        assert idle == pytest.approx(0.0, abs=1e-9), r


def test_v_min_bubble_grows_with_m_when_times_differ() -> None:
    """docs/facts.md: V-Min develops a repeating bubble at T_F=3, T_B=4, T_W=2: the idle time grows
    with every micro-batch added (at unit times it stays constant)."""
    from flexpipe.ir import Placement

    p = 4
    idle = {}
    for label, (f, b, w) in {"uneven": (3.0, 4.0, 2.0), "unit": (1.0, 1.0, 1.0)}.items():
        cost = CostModel.per_rank(Placement.vshape(p).stage_rank, p, f=f, b=b, w=w)
        idle[label] = []
        for m in (8, 16, 32):
            met = simulate(v_min(p, m, cost), cost).metrics()
            idle[label].append(p * max(met.span) - sum(met.useful))
    u = idle["uneven"]
    assert u[0] < u[1] < u[2] and u[2] - u[1] > 1.5 * (u[1] - u[0]) * 0.9
    assert idle["unit"][0] == pytest.approx(idle["unit"][2])


@pytest.mark.parametrize("p", [2, 4, 6, 8])
@pytest.mark.parametrize(("w_delay", "b_gap"), [(0.0, 0.0), (3.0, 0.0), (12.0, 1.0)])
def test_block_bound_never_below_simulated_peak(p: int, w_delay: float, b_gap: float) -> None:
    block, cost = v_block(p, w_delay=w_delay, b_gap=b_gap)
    bound = block.memory_bound(cost)
    for m in (1, p, 3 * p):
        peaks = simulate(block.schedule(m), cost).metrics().peak_activation
        assert all(pk <= bd + 1e-9 for pk, bd in zip(peaks, bound, strict=True))
    # the peak is reached in the steady phase: with enough micro-batches the bound is attained
    # on the rank whose lifespans fill whole intervals
    peaks = simulate(block.schedule(4 * p), cost).metrics().peak_activation
    assert max(peaks) >= max(bound) - max(cost.stage(s).act for s in range(2 * p)) - 1e-9


def test_block_bound_equals_peak_at_unit_cost_for_v_min_shape() -> None:
    block, cost = v_block(4, w_delay=1.0)
    peaks = simulate(block.schedule(16), cost).metrics().peak_activation
    bound = block.memory_bound(cost)
    assert math.isclose(max(peaks), max(bound) - 0.5) or max(peaks) == max(bound)


def test_zero_time_weight_pass_is_allowed() -> None:
    """A cost model whose W takes no time (all weight-gradient work fused elsewhere) builds
    every V-shape schedule; passes of no time never collide in a building block."""
    from flexpipe.ir import Placement

    p, m = 4, 8
    cost = CostModel.per_rank(Placement.vshape(p).stage_rank, p, w=0.0)
    for fn in (v_min, v_half, v_zb, zb_v):
        sched = fn(p, m, cost)
        assert validate(sched) == []
        assert simulate(sched, cost).metrics().makespan > 0
