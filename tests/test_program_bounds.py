"""A DSL schedule program is bounded: one that never ends (a loop in its function, at its top
level, one catching every ``Exception``, a long sleep) is stopped at its time limit with an
error naming the line it was at and ``--program-timeout``; a caller's own alarm is put back
afterwards. What a program prints goes to stderr: ``--json`` output stays one JSON object."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from cli_calls import call
from flexpipe.dsl.loader import load_program
from flexpipe.errors import ConfigError
from flexpipe.specs import load

EXAMPLE = Path(__file__).parent.parent / "examples" / "my_1f1b_early_w.py"
ENDLESS = {
    "loop in the function": ("def schedule(p, m):\n    n = 0\n    while True:\n"
                             "        n += 1\n", (3, 4)),
    "loop at top level": ("import itertools\nfor i in itertools.count():\n    pass\n", (2, 3)),
    "swallowing every Exception": ("def schedule(p, m):\n    while True:\n        try:\n"
                                   "            sum(range(1000))\n        except Exception:\n"
                                   "            pass\n", (2, 3, 4, 5, 6)),
    "sleeping": ("import time\n\ndef schedule(p, m):\n    time.sleep(3600)\n", (4,)),
}


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_an_endless_program_is_stopped_at_its_line(tmp_path: Path, name: str) -> None:
    source, lines = ENDLESS[name]
    path = tmp_path / "endless.py"
    path.write_text(source)
    with pytest.raises(ConfigError) as info:
        load(str(path), 2, 4, program_timeout_s=0.3)
    text = str(info.value)
    assert any(text.startswith(f"{path}:{line}: ") for line in lines), text
    assert "ran past its time limit of 0.3s" in text and "--program-timeout" in text, text


def test_the_command_line_limit_is_named_and_the_exit_code_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "forever.py"
    path.write_text("def schedule(p, m):\n    while True:\n        pass\n")
    code, out, err = call(capsys, "simulate", str(path), "-p", "2", "-m", "4", "--json",
                          "--program-timeout", "0.3")
    assert code == 2 and out == "", (code, out)
    assert any(f"{path}:{line}: the schedule program ran past its time limit of 0.3s" in err
               for line in (2, 3)), err


def test_a_callers_alarm_is_put_back(tmp_path: Path) -> None:
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 600)
    try:
        sched = load_program(str(EXAMPLE), 2, 4, timeout_s=30)
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        mine = signal.getsignal(signal.SIGALRM)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert sched.num_ranks == 2 and 0 < left <= 600 and not fired
    assert mine is not None and mine not in (signal.SIG_DFL, signal.SIG_IGN)
    assert getattr(mine, "__name__", "") == "<lambda>"


def test_what_a_program_prints_goes_to_stderr(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chatty.py"
    path.write_text(EXAMPLE.read_text().replace(
        "    prog = Program(", "    print('building', p, m)\n    prog = Program(", 1))
    code, out, err = call(capsys, "simulate", str(path), "-p", "2", "-m", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["schedule"]  # stdout is one JSON object
    assert "building 2 4" in err and "building" not in out
