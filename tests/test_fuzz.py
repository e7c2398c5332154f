"""Hostile input, short version of ``benchmarks/fuzz.py``: every entry point that reads user input
(schedule text, torch CSV, cost files and dicts, the validator, the library, schedule specs and
DSL programs, the command line on hostile files, flags and output paths) either succeeds or
raises a ``FlexPipeError`` on a few hundred seeded random and mutated inputs, with no hang and
no silent wrong result. And no loader of user files deserialises with pickle, ``eval`` or an unsafe
``torch.load``."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "flexpipe"
CASES = 300
MEMORY = "256MiB"
"""What the size guards are told here: the largest schedule a case may build is then about 64k
ops (a few seconds on a quiet machine), whatever the suite's own ``FLEXPIPE_MEMORY`` says."""
HANG_S = 300.0
"""A case over this is stuck, not slow: far above what the guard above lets any case reach, so
the verdict does not depend on how busy the machine is."""

sys.path.insert(0, str(ROOT / "benchmarks"))
fuzz = importlib.import_module("fuzz")


@pytest.fixture(scope="module")
def rows() -> dict[str, Any]:
    return {row.name: row for row in fuzz.run_all(CASES, seed=1, memory=MEMORY, limit_s=HANG_S)}


@pytest.mark.parametrize("name", list(fuzz.ENTRY_POINTS))
def test_only_flexpipe_errors_escape(rows: dict[str, Any], name: str) -> None:
    row = rows[name]
    assert row.cases == CASES
    assert row.other == 0 and row.hangs == 0 and row.wrong == 0, \
        "\n".join(row.examples.values())


def test_fuzz_exercises_both_outcomes(rows: dict[str, Any]) -> None:
    """Each entry point sees inputs it accepts and inputs it rejects (the generators are not
    all-garbage nor all-valid)."""
    for row in rows.values():
        assert row.accepted > 0 and row.rejected > 0, row


def test_table_prints_every_entry_point(rows: dict[str, Any]) -> None:
    text = fuzz.table(list(rows.values()))
    assert all(name in text for name in fuzz.ENTRY_POINTS)
    assert "other exceptions" in text


# Internal, not a loader of files: the launcher reads back the results its own ranks send over
# a private pipe (runtime/processes/supervise.py), and a rank its task from the launcher
# (runtime/processes/rankstart.py); and the guard that reads a DCP
# folder's metadata with an unpickler that builds only DCP's own classes, refusing the rest
# (runtime/transport/safedcp.py, tested against forged payloads in tests/runtime).
PICKLE_ALLOWED = {"runtime/processes/supervise.py", "runtime/processes/rankstart.py",
                  "runtime/transport/safedcp.py"}
UNSAFE = {
    "pickle": re.compile(r"\b(c?pickle|dill|marshal|shelve)\b"),
    "eval(": re.compile(r"(?<![.\w`])(?<!def )eval\("),  # not a method named eval
    "yaml.load(": re.compile(r"\byaml\.load\("),
}
TORCH_LOAD = re.compile(r"torch\.load\(([^()]|\([^()]*\))*\)", re.S)


def test_no_unsafe_deserialisation() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text(encoding="utf-8")
        for what, pattern in UNSAFE.items():
            if pattern.search(text) and not (what == "pickle" and rel in PICKLE_ALLOWED):
                found.append(f"{rel}: {what}")
        for call in TORCH_LOAD.finditer(text):
            if not re.search(r"weights_only\s*=\s*True", call.group(0)):
                found.append(f"{rel}: torch.load without weights_only=True")
    assert not found, "unsafe loading in src/: " + "; ".join(found)


def test_scanner_catches_what_it_should() -> None:
    assert UNSAFE["eval("].search("x = eval(text)")
    assert not UNSAFE["eval("].search("model.eval()")
    assert not UNSAFE["eval("].search("    def eval(self, inputs):")
    assert not UNSAFE["eval("].search("and ``eval(inputs)`` (forward only)")
    assert UNSAFE["eval("].search("y = (eval(code))")
    assert UNSAFE["pickle"].search("import pickle")
    bad = TORCH_LOAD.search("torch.load(open(p, 'rb'))")
    assert bad and "weights_only" not in bad.group(0)
    good = TORCH_LOAD.search("torch.load(f, map_location='cpu', weights_only=True)")
    assert good and "weights_only=True" in good.group(0)
