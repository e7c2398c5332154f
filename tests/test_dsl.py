"""The DSL: combinators, the Program builder, policies, building blocks, user-declared op kinds
and user schedule files with errors at the user's own line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexpipe.cli.main import main
from flexpipe.cost import CostModel
from flexpipe.cost.model import Comm, StageCost
from flexpipe.dsl import (
    MemEffect,
    Need,
    Op,
    Passes,
    Placement,
    Policy,
    Program,
    after_each,
    alternate,
    greedy_block,
    interleave,
    op_kind,
    policy_schedule,
)
from flexpipe.dsl.block import Block
from flexpipe.errors import ConfigError
from flexpipe.ir import Gate, parse_schedule
from flexpipe.sim import simulate
from flexpipe.sim.validate import validate
from flexpipe.specs import load

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_1f1b_early_w.py"


def ops(kind: str, n: int) -> Passes:
    return Passes(Op(kind, 0, j) for j in range(n))


def test_take_alternate_interleave_after_each() -> None:
    fs, bs = ops("F", 4), ops("BW", 4)
    assert [str(o) for o in fs.take(2)] == ["0F0", "0F1"]
    assert [str(o) for o in alternate(fs, bs)] == ["0F2", "0BW0", "0F3", "0BW1"]
    assert [str(o) for o in bs] == ["0BW2", "0BW3"]
    assert [str(o) for o in interleave(ops("F", 2), ops("B", 1))] == ["0F0", "0B0", "0F1"]
    seq = [Op("B", 0, 0), Op("F", 0, 1), Op("B", 0, 1)]
    got = after_each(seq, ops("W", 2), lag=1, on="B")
    assert [str(o) for o in got] == ["0B0", "0F1", "0B1", "0W0", "0W1"]


def test_program_requires_every_rank_and_known_kinds() -> None:
    prog = Program(Placement.linear(2), 2)
    prog.order(0, prog.queue(0, "F"), prog.queue(0, "BW"))
    with pytest.raises(ConfigError, match=r"no order given for rank\(s\) \[1\]"):
        prog.build()
    with pytest.raises(ConfigError, match="unknown op kind 'NOPE'"):
        prog.queue(0, "NOPE")
    with pytest.raises(ConfigError, match="rank 5 is outside"):
        prog.order(5, [])
    with pytest.raises(ConfigError, match="positive integer"):
        Program(Placement.linear(2), 0)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), limit=st.floats(1.0, 8.0), split=st.booleans())
def test_policy_respects_memory_limit_and_validates(p: int, m: int, limit: float,
                                                    split: bool) -> None:
    placement = Placement.vshape(p)
    try:
        sched = policy_schedule(placement, m, Policy(mem_limit=limit, split=split))
    except ConfigError as exc:  # a limit below one micro-batch's need: said clearly
        assert "cannot finish" in str(exc)
        return
    assert validate(sched) == []
    peak = max(simulate(sched).metrics().peak_activation)
    assert peak <= limit + 1e-9


def test_policy_that_cannot_fit_says_which_rank() -> None:
    with pytest.raises(ConfigError, match=r"rank 0 stuck .*limit 0.5"):
        policy_schedule(Placement.vshape(2), 2, Policy(mem_limit=0.5))


def test_block_overlapping_itself_is_rejected() -> None:
    placement = Placement.linear(1)
    cost = CostModel.uniform(1, 1)
    offsets = {Op("F", 0, 0): 0.0, Op("B", 0, 0): 0.5, Op("W", 0, 0): 2.0}
    durations = {op: 1.0 for op in offsets}
    with pytest.raises(ConfigError, match="overlaps itself on rank 0"):
        Block(placement, offsets, durations, 3.0)
    block = greedy_block(placement, cost, 3.0)
    assert block.lifespan(0) == 3.0
    assert block.memory_bound(cost) == [1.0]


def test_user_declared_kind_flows_through_every_layer() -> None:
    """A kind declared in the DSL is validated, simulated, printed, parsed and drawn with no
    edits elsewhere: here a host-side 'CKPT' that snapshots activations after the forward."""
    ckpt = op_kind("CKPT", "snapshot activations to host", needs=[Need(("F",))],
                   gates=[Gate(("BW",))], time={"F": 0.25}, stream="d2h",
                   memory=[MemEffect("act", 0.5, pool="host")], glyph="k")
    assert ckpt.name == "CKPT"
    prog = Program(Placement.linear(2), 2, name="ckpt")
    for r in prog.ranks:
        fwd = [op for j in range(2) for op in (Op("F", r, j), Op("CKPT", r, j))]
        prog.order(r, fwd, prog.queue(r, "BW"))
    sched = prog.build()
    assert validate(sched) == []
    trace = simulate(sched)
    assert trace.metrics().makespan > 0
    assert parse_schedule(sched.to_text()) == sched
    from flexpipe.viz.terminal import timeline

    assert "rank 1" in str(timeline(trace, width=80, color=False))


def test_user_schedule_file_runs_and_draws(capsys: pytest.CaptureFixture[str]) -> None:
    sched = load(str(EXAMPLE), 4, 8)
    assert validate(sched) == [] and sched.name == "1f1b-w-slip"
    assert main(["show", str(EXAMPLE), "-p", "4", "-m", "8", "--no-color"]) == 0
    assert "rank 3" in capsys.readouterr().out


@pytest.mark.parametrize(("source", "line", "message"), [
    ("def schedule(p, m)\n    return 1\n", 1, "syntax error"),
    ("from flexpipe.dsl import Program, Placement\n\ndef schedule(p, m):\n"
     "    prog = Program(Placement.linear(p), m)\n    prog.order(0, prog.queue(0, 'Q'))\n",
     5, "unknown op kind 'Q'"),
    ("def schedule(p, m):\n    return 1 / 0\n", 2, "ZeroDivisionError"),
    ("import nonexistent_module_xyz\n", 1, "ModuleNotFoundError"),
    ("def schedule(p, m):\n    return 42\n", None, "returned int, expected a Schedule"),
    ("x = 1\n", None, "defines no schedule"),
])
def test_errors_point_at_the_users_line(tmp_path: Path, source: str, line: int | None,
                                        message: str) -> None:
    path = tmp_path / "mine.py"
    path.write_text(source)
    with pytest.raises(ConfigError) as info:
        load(str(path), 2, 2)
    text = str(info.value)
    assert message in text
    if line is not None:
        assert text.startswith(f"{path}:{line}:")


def test_cli_reports_user_file_error_in_one_line(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.py"
    path.write_text("def schedule(p, m):\n    raise ValueError('nope')\n")
    assert main(["show", str(path), "-p", "2", "-m", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: ValueError: nope" in err and "Traceback" not in err


def test_exact_block_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Solved blocks are reused for the same input and the cache keeps only the newest."""
    from flexpipe.dsl import block_exact

    monkeypatch.setattr(block_exact, "CACHE_SIZE", 2)
    monkeypatch.setattr(block_exact, "_CACHE", {})
    place = Placement.vshape(2)
    costs = [CostModel(tuple(StageCost({"F": 1.0, "B": b, "W": 0.5}) for _ in range(4)),
                       Comm.uniform(2)) for b in (1.0, 1.5, 2.0)]
    first = block_exact.exact_block(place, costs[0], 4.0, effort=0.5)
    assert block_exact.exact_block(place, costs[0], 4.0, effort=0.5) is first
    for cost in costs[1:]:
        block_exact.exact_block(place, cost, 4.0, effort=0.5)
    assert len(block_exact._CACHE) == 2
    assert not any(repr(costs[0]) in key for key in block_exact._CACHE)
