"""Property tests of the schedule's two text forms: random valid schedules round-trip exactly
through the FlexPipe text format and (for the F/B/W/BW subset on a chain) through torch's
compute-only CSV; mutated or random text only ever raises FlexPipe errors. Plus a golden file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexpipe.errors import ConfigError, FlexPipeError, ParseError
from flexpipe.ir import BW, B, F, Op, Placement, R, Schedule, StageGraph, W
from flexpipe.ir.text import format_schedule, parse_schedule
from flexpipe.ir.torch_csv import from_torch_csv, to_torch_csv
from flexpipe.schedules.registry import build
from flexpipe.specs import load

GOLDEN = Path(__file__).parent / "golden"
# FLEXPIPE_FUZZ_EXAMPLES=3000 runs a longer fuzz locally.
SETTINGS = settings(max_examples=int(os.environ.get("FLEXPIPE_FUZZ_EXAMPLES", "150")),
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Names: printable text without line breaks of any kind (str.splitlines splits on \x85 etc.).
NAME_CHARS = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))
NAMES = st.text(NAME_CHARS, max_size=12).map(str.strip)


@st.composite
def placements(draw: st.DrawFn) -> Placement:
    """Linear, interleaved, V-shape, zig-zag or an arbitrary mapping over 1..4 ranks."""
    p = draw(st.integers(1, 4))
    shape = draw(st.sampled_from(["linear", "interleaved", "vshape", "zigzag", "explicit"]))
    if shape == "explicit":
        ranks = draw(st.lists(st.integers(0, p - 1), min_size=1, max_size=8))
        return Placement(tuple(ranks), p)
    makers = {"linear": lambda: Placement.linear(p),
              "interleaved": lambda: Placement.interleaved(p, draw(st.integers(1, 3))),
              "vshape": lambda: Placement.vshape(p),
              "zigzag": lambda: Placement.zigzag(p, draw(st.integers(1, 4)))}
    return makers[shape]()


@st.composite
def graphs(draw: st.DrawFn, num_stages: int) -> StageGraph | None:
    """Usually the chain (None); sometimes a random DAG (edges only go to later stages)."""
    if num_stages < 2 or draw(st.integers(0, 4)) > 0:
        return None
    pairs = [(a, b) for a in range(num_stages) for b in range(a + 1, num_stages)]
    return StageGraph(num_stages, tuple(draw(st.lists(st.sampled_from(pairs), unique=True))))


@st.composite
def schedules(draw: st.DrawFn, csv_only: bool = False) -> Schedule:
    """A complete schedule (every stage x micro-batch has F and BW or B+W, maybe R) in a random
    order per rank; with ``csv_only``, a chain with F/B/W/BW only."""
    placement = draw(placements())
    m = draw(st.integers(1, 4))
    per_rank: list[list[Op]] = [[] for _ in range(placement.num_ranks)]
    for s, r in enumerate(placement.stage_rank):
        for j in range(m):
            per_rank[r].append(F(s, j))
            per_rank[r] += [B(s, j), W(s, j)] if draw(st.booleans()) else [BW(s, j)]
            if not csv_only and draw(st.integers(0, 5)) == 0:
                per_rank[r].append(R(s, j))
    ranks = [draw(st.permutations(ops)) for ops in per_rank]
    graph = None if csv_only else draw(graphs(placement.num_stages))
    name = "" if csv_only else draw(NAMES)
    return Schedule.build(ranks, placement, m, graph, name)


def same(a: Schedule, b: Schedule) -> bool:
    """Equal in everything the text forms carry (a placement's ``kind`` label is not carried)."""
    return (a.ranks == b.ranks and a.placement.stage_rank == b.placement.stage_rank
            and a.num_ranks == b.num_ranks and a.microbatches == b.microbatches
            and a.graph == b.graph and a.name == b.name)


# --- round trips ------------------------------------------------------------------------------

@SETTINGS
@given(schedules())
def test_text_round_trip_is_exact(schedule: Schedule) -> None:
    text = format_schedule(schedule)
    back = parse_schedule(text)
    assert same(back, schedule)
    assert format_schedule(back) == text


@SETTINGS
@given(schedules(csv_only=True))
def test_torch_csv_round_trip_is_exact(schedule: Schedule) -> None:
    csv = to_torch_csv(schedule)
    assert same(from_torch_csv(csv), schedule)
    assert same(from_torch_csv(csv, schedule.placement, schedule.microbatches), schedule)
    assert to_torch_csv(from_torch_csv(csv)) == csv


def test_torch_csv_names_and_layout() -> None:
    schedule = Schedule.build([[F(0, 0), B(0, 0), W(0, 0)], [], [F(1, 0), BW(1, 0)]],
                              Placement.explicit([0, 2], 3), 1)
    assert to_torch_csv(schedule) == "0F0,0I0,0W0\n\n1F0,1B0\n"
    assert same(from_torch_csv(to_torch_csv(schedule)), schedule)
    assert to_torch_csv(build("1f1b", 2, 1)) == "0F0,0B0\n1F0,1B0\n"


def test_torch_csv_import_tolerates_torch_spellings() -> None:
    text = "0F0, 0F1,,0B0,\"0B1\"\r\n1F0,1B0,1F1,1B1\r\n"
    schedule = from_torch_csv(text)
    assert schedule.ranks == build("1f1b", 2, 2).ranks[:1] + (
        (F(1, 0), BW(1, 0), F(1, 1), BW(1, 1)),)


def test_torch_can_load_our_csv(tmp_path: Path) -> None:
    sched_mod = pytest.importorskip("torch.distributed.pipelining.schedules")
    for name, p, m, v in (("1f1b", 4, 8, None), ("zb-h1", 3, 6, None),
                          ("interleaved-1f1b", 2, 4, 2)):
        schedule = build(name, p, m, v=v)
        rows = to_torch_csv(schedule).splitlines()
        actions = {r: [sched_mod._Action.from_str(c) for c in row.split(",")]
                   for r, row in enumerate(rows)}
        mapping = sched_mod._validate_schedule(actions, p, schedule.num_stages, m)
        assert [mapping[s] for s in range(schedule.num_stages)] == list(
            schedule.placement.stage_rank)
        back = {r: ",".join(str(a) for a in acts) for r, acts in actions.items()}
        assert "\n".join(back.values()) + "\n" == to_torch_csv(schedule)


def test_csv_cannot_express_other_kinds() -> None:
    with pytest.raises(ConfigError, match=r"rank 0, position 2: op 0R0 .*only F, B, W, BW"):
        to_torch_csv(build("1f1b-recompute", 2, 2))


@pytest.mark.parametrize("text, where", [
    ("0F0,0X0\n", "column 5"),
    ("0F0,1UNSHARD\n", "not a compute action"),
    ("0F0\n0F1\n", "stage 0 appears on rank 1 and on rank 0"),
    ("0F0,0B0\n2F0,2B0\n", "stage 1 appears on no rank"),
    ("0F0,0B\n", "no micro-batch index"),
    ("0F0,0B99999999999999\n", "too large"),
    ("", "no actions"),
    ("\n\n", "no actions"),
])
def test_csv_parse_errors(text: str, where: str) -> None:
    with pytest.raises(ParseError, match=where):
        from_torch_csv(text)


def test_csv_with_explicit_placement_and_microbatches() -> None:
    text = "0F0,0B0\n1F0,1B0\n"
    schedule = from_torch_csv(text, Placement.linear(2), 3)
    assert schedule.microbatches == 3
    with pytest.raises(ParseError, match="placement puts it on rank 0"):
        from_torch_csv(text, Placement.explicit([0, 0], 2))
    with pytest.raises(ParseError, match="2 rows"):
        from_torch_csv(text, Placement.linear(3))
    with pytest.raises(ParseError, match=r"line 2, column 1: micro-batch 1 is outside 0..0"):
        from_torch_csv("0F0\n1F1\n", microbatches=1)


def test_csv_files_load_through_the_registry(tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    path.write_text(to_torch_csv(build("zb-h1", 3, 4)))
    assert load(str(path)).ranks == build("zb-h1", 3, 4).ranks


# --- malformed input --------------------------------------------------------------------------

TOKENS = [" ", "\n", ":", ">", "rank 0:", "0Q0", "-1", "0F", "name:", "#", ",", "0>0", "\r"]


def _mutate(text: str, data: st.DataObject) -> str:
    """Random insertions, deletions and replacements of characters, tokens or huge numbers."""
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.sampled_from([0, 0, 1, 2, 5]))  # 0 = insert only
        insert = data.draw(st.one_of(st.text(max_size=4), st.sampled_from(TOKENS),
                                     st.integers(0, 10**30).map(str)))
        text = text[:i] + insert + text[min(len(text), i + cut):]
    return text


@SETTINGS
@given(schedules(), st.data())
def test_mutated_text_raises_only_parse_errors(schedule: Schedule, data: st.DataObject) -> None:
    text = _mutate(format_schedule(schedule), data)
    try:
        parse_schedule(text)
    except FlexPipeError:
        pass


@SETTINGS
@given(schedules(csv_only=True), st.data())
def test_mutated_csv_raises_only_parse_errors(schedule: Schedule, data: st.DataObject) -> None:
    text = _mutate(to_torch_csv(schedule), data)
    try:
        from_torch_csv(text)
    except FlexPipeError:
        pass


@SETTINGS
@given(st.text(max_size=200))
def test_random_unicode_raises_only_parse_errors(text: str) -> None:
    headers = ("", "flexpipe-schedule v1\n", "flexpipe-schedule v1\nranks: 1 stages: 1 "
               "microbatches: 1\nplacement: 0\nrank 0: ")
    attempts = [(from_torch_csv, text)] + [(parse_schedule, h + text) for h in headers]
    for parser, arg in attempts:
        try:
            parser(arg)
        except ParseError:
            pass


@pytest.mark.parametrize("text", [
    "flexpipe-schedule v1\nranks: 99999999999 stages: 1 microbatches: 1\n",
    "flexpipe-schedule v1\nranks: 1 stages: 1 microbatches: 1\nplacement: 0\n"
    "rank 0: 0F99999999999999999999\n",
    "flexpipe-schedule v1\nranks: 1 stages: 2 microbatches: 1\nplacement: 0 0\n"
    "edges: 0>1 1>0\nrank 0: 0F0\n",
])
def test_huge_numbers_and_cycles_are_parse_errors(text: str) -> None:
    with pytest.raises(ParseError):
        parse_schedule(text)


# --- golden -----------------------------------------------------------------------------------

def test_golden_1f1b_p4_m8() -> None:
    golden = (GOLDEN / "1f1b_p4_m8.txt").read_text(encoding="utf-8")
    assert format_schedule(build("1f1b", 4, 8)) == golden
    assert parse_schedule(golden).ranks == build("1f1b", 4, 8).ranks
