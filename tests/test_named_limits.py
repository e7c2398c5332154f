"""A number past what a schedule text holds is refused naming the limit, not as if it were not
a number: a count (ranks, stages, micro-batches) or an index of 10 digits and more says "must be
at most 999999999" (a long one shown cut, with its length); 0 and non-digits keep their own
messages; every count up to the limit passes the counts line."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.errors import ParseError
from flexpipe.ir.text import LARGEST, parse_schedule

HEAD = "flexpipe-schedule v1\n"


def _said(text: str) -> str:
    with pytest.raises(ParseError) as info:
        parse_schedule(text)
    return str(info.value)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["ranks", "stages", "microbatches"]), st.integers(10, 60))
def test_a_count_past_the_limit_names_it(which: str, digits: int) -> None:
    counts = {"ranks": "2", "stages": "2", "microbatches": "4"}
    counts[which] = "1" + "0" * (digits - 1)
    said = _said(HEAD + " ".join(f"{k}: {v}" for k, v in counts.items()) + "\n")
    assert f"a count must be at most {LARGEST}" in said, said
    assert len(said) < 200 and (digits <= 16 or f"({digits} digits)" in said), said


@settings(max_examples=40, deadline=None)
@given(st.integers(1, LARGEST))
def test_every_count_up_to_the_limit_passes_the_counts_line(m: int) -> None:
    said = _said(HEAD + f"ranks: 1 stages: 1 microbatches: {m}\nplacement: 0\n")
    assert "at most" not in said and "positive integers" not in said, said


@pytest.mark.parametrize(("value", "message"), [("0", "counts must be positive integers"),
                                                ("x1", "counts must be positive integers"),
                                                ("1000000000", "must be at most 999999999")])
def test_each_bad_count_keeps_its_own_message(value: str, message: str) -> None:
    assert message in _said(HEAD + f"ranks: 2 stages: 2 microbatches: {value}\n")
