"""The one memory-limit type (``flexpipe.cost.limits``): its text form, its units against unit
and byte cost models, per-rank values, and the same parser behind run, search, validate and
the library functions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexpipe.cli.main import main
from flexpipe.cost.limits import BYTE_UNITS, MemLimit, parse
from flexpipe.cost.model import CostModel
from flexpipe.errors import ConfigError
from flexpipe.schedules.registry import build
from flexpipe.search import search
from flexpipe.sim.validate import validate

BYTES_COST = CostModel.uniform(2, 2, act=4096.0, wact=2048.0)
"""A cost model whose memory is in bytes (M_B = 4 KiB on every stage)."""


def test_a_plain_number_is_m_b_and_a_size_is_bytes() -> None:
    assert parse("8") == MemLimit((8.0,), "M_B")
    assert parse("6GiB") == MemLimit((6 * 2**30,), "bytes")
    assert parse("512 MiB").values == (512 * 2**20,)
    assert parse("8,8,6,6").per_rank(4) == (8.0, 8.0, 6.0, 6.0)
    assert parse("2").per_rank(3) == (2.0, 2.0, 2.0)


def test_units_against_the_cost_model() -> None:
    assert parse("2").per_rank(2, BYTES_COST) == (8192.0, 8192.0)  # 2 x M_B
    assert parse("1MiB").per_rank(2, BYTES_COST) == (2.0**20,) * 2
    assert MemLimit.of(5000.0).per_rank(2, BYTES_COST) == (5000.0, 5000.0)  # the model's unit
    with pytest.raises(ConfigError, match="in bytes but the cost model's memory is in M_B"):
        parse("6GiB").per_rank(2, CostModel.uniform(2, 2))
    with pytest.raises(ConfigError, match="in bytes but"):
        parse("6GiB").per_rank(2)  # unit costs


@pytest.mark.parametrize(("text", "message"), [
    ("lots", "'lots' is not a number"), ("", "is not a number"), ("6XB", "is not a number"),
    ("-1", "must be a positive number"), ("0", "must be a positive number"),
    ("nan", "must be a positive number"), ("inf", "must be a positive number"),
    ("6GiB,3", "mixes M_B and bytes"), ("8,x", "'x' is not a number"),
    ("2,0", "for rank 1 must be a positive number"),
])
def test_bad_text_is_named(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(text)


@pytest.mark.parametrize("limit", [True, None, {"a": 1}, [1, None], [1.0, -2.0]])
def test_bad_library_values_are_refused(limit: object) -> None:
    with pytest.raises(ConfigError, match="memory limit"):
        MemLimit.of(limit)  # type: ignore[arg-type]


def test_the_rank_count_must_match() -> None:
    with pytest.raises(ConfigError, match=r"one per rank \(2\), got 3"):
        parse("1,2,3").per_rank(2)


@given(st.lists(st.floats(min_value=1e-3, max_value=1e12), min_size=1, max_size=6),
       st.sampled_from(["", *BYTE_UNITS]))
def test_any_positive_list_parses_back(values: list[float], suffix: str) -> None:
    text = ",".join(f"{v!r}{suffix}" for v in values)
    got = parse(text)
    scale = BYTE_UNITS.get(suffix.lower(), 1) if suffix else 1
    assert got.unit == ("bytes" if suffix else "M_B")
    assert got.values == pytest.approx([v * scale for v in values])


def test_search_validate_and_the_cli_share_it(capsys: pytest.CaptureFixture[str]) -> None:
    schedule = build("gpipe", 2, 4)
    assert validate(schedule, mem_limit="4") == []
    assert {v.rule for v in validate(schedule, mem_limit="3")} == {"memory"}
    assert search(None, 2, 4, "2").best is not None
    assert main(["validate", "gpipe", "-p", "2", "-m", "4", "--mem", "3"]) == 1
    assert main(["validate", "gpipe", "-p", "2", "-m", "4", "--mem", "1GiB"]) == 2
    assert "in bytes but the cost model's memory is in M_B" in capsys.readouterr().err
    assert main(["search", "-p", "2", "-m", "4", "--mem", "2,0"]) == 2
    assert "for rank 1 must be a positive number" in capsys.readouterr().err
