"""The learning-rate schedule of ``flexpipe run`` (torchtitan's ``[lr_scheduler]`` meaning):
warm-up, stable phase, linear/sqrt/cosine decay to ``min_lr_factor``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexpipe.errors import ConfigError
from flexpipe.runtime.processes.lrschedule import DECAYS, LRSchedule


def test_warmup_then_linear_decay_has_torchtitans_factors() -> None:
    """10 steps, 2 of warm-up, linear decay over the other 8 (torchtitan's one stable step)."""
    s = LRSchedule(10, warmup_steps=2, decay_type="linear")
    assert s.phases() == (2, 1, 8)
    got = [s.factor(k) for k in range(10)]
    want = [1 / 3, 2 / 3, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8]
    assert got == pytest.approx(want)


def test_wsd_keeps_the_rate_until_the_decay_ratio_and_ends_at_the_floor() -> None:
    s = LRSchedule(20, warmup_steps=0, decay_ratio=0.25, decay_type="cosine", min_lr_factor=0.1)
    warmup, stable, decay = s.phases()
    assert (warmup, decay) == (0, 5)
    assert all(s.factor(k) == 1.0 for k in range(stable))
    tail = [s.factor(k) for k in range(stable, 20)]
    assert tail == sorted(tail, reverse=True) and tail[-1] < 1.0
    assert tail[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 5)))


def test_constant_is_one_after_the_warmup() -> None:
    s = LRSchedule(6, warmup_steps=3)
    assert [s.factor(k) for k in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])


@pytest.mark.parametrize(("field", "value", "words"), [
    ("decay_type", "step", "decay_type 'step' is not one of"),
    ("warmup_steps", -1, "warmup_steps must be >= 0"),
    ("decay_ratio", 1.5, "decay_ratio must be in [0, 1]"),
    ("min_lr_factor", -0.1, "min_lr_factor must be in [0, 1]"),
])
def test_bad_settings_are_named(field: str, value: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        LRSchedule(10, **{field: value})  # type: ignore[arg-type]


@given(steps=st.integers(1, 300), warmup=st.integers(0, 400),
       ratio=st.one_of(st.none(), st.floats(0, 1)), kind=st.sampled_from(sorted(DECAYS)),
       floor=st.floats(0, 1))
def test_factors_rise_then_never_rise_again_within_the_floor_and_one(
        steps: int, warmup: int, ratio: float | None, kind: str, floor: float) -> None:
    s = LRSchedule(steps, warmup, ratio, kind, floor)
    factors = [s.factor(k) for k in range(steps)]
    w = s.phases()[0]
    assert all(min(floor, 1 / (w + 1)) - 1e-12 <= f <= 1.0 for f in factors)
    assert factors[:w] == sorted(factors[:w])
    assert factors[w:] == sorted(factors[w:], reverse=True)
