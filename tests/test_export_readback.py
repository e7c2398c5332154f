"""Every library schedule, exported as text (and as torch CSV where that format can express it),
reads back with ``show``, ``simulate`` and ``validate`` in a fresh process: reading a schedule
must not depend on which modules the writer happened to import (the standard extra kinds AG, RS,
OFFLOAD, RELOAD, SR are registered with the built-in ones, not by importing the DSL)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from flexpipe.cli.main import main
from flexpipe.ir.kinds import KINDS, STANDARD
from flexpipe.ir.torch_csv import FROM_TORCH
from flexpipe.schedules.registry import build, names

P, M = 4, 8
READERS = ("show", "simulate", "validate")
# One fresh interpreter per reader: runs the CLI on every file and reports each exit code, and
# which of the standard kinds were known before anything but the reader was imported.
CHILD = """
import contextlib, io, json, sys
from flexpipe.cli.main import main
codes = {}
for path in sys.argv[3:]:
    args = [sys.argv[1], path] + (["-m", sys.argv[2]] if path.endswith(".csv") else [])
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes[path] = main(args)
        except SystemExit as exc:
            codes[path] = exc.code
print(json.dumps(codes))
"""


def _csv_expressible(name: str) -> bool:
    """Whether torch's compute-only CSV can hold the schedule (only F, B, W, BW ops, on a chain
    of stages)."""
    sched = build(name, P, M)
    return sched.graph.chain_edges and all(op.kind in FROM_TORCH.values()
                                           for ops in sched.ranks for op in ops)


def _export(tmp: Path) -> list[str]:
    """Export the whole library into ``tmp``; the paths written."""
    paths = []
    for name in names():
        out = tmp / f"{name}.txt"
        assert main(["export", name, "-p", str(P), "-m", str(M), "-o", str(out)]) == 0, name
        paths.append(str(out))
        if _csv_expressible(name):
            csv = tmp / f"{name}.csv"
            assert main(["export", name, "-p", str(P), "-m", str(M), "--format", "torch-csv",
                         "-o", str(csv)]) == 0, name
            paths.append(str(csv))
    return paths


def test_library_exports_read_back_in_a_fresh_process(tmp_path: Path) -> None:
    paths = _export(tmp_path)
    assert any(p.endswith("zeropp.txt") for p in paths)  # AG and RS ops
    assert any(p.endswith("1f1b-offload.txt") for p in paths)  # OFFLOAD and RELOAD ops
    assert sum(p.endswith(".csv") for p in paths) >= len(names()) // 2
    for reader in READERS:
        done = subprocess.run([sys.executable, "-c", CHILD, reader, str(M), *paths],
                              capture_output=True, text=True, timeout=300, check=True)
        codes = json.loads(done.stdout)
        failed = {Path(p).name: c for p, c in codes.items() if c != 0}
        assert not failed, f"flexpipe {reader} failed on {failed}"
        assert len(codes) == len(paths)


def test_standard_kinds_are_known_without_the_dsl() -> None:
    code = ("import sys; from flexpipe.ir.kinds import KINDS; "
            "assert 'flexpipe.dsl' not in sys.modules; print(' '.join(KINDS.names()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    known = set(done.stdout.split())
    assert {k.name for k in STANDARD} <= known
    assert {"AG", "RS", "OFFLOAD", "RELOAD", "SR"} <= known
    assert set(KINDS.names()) >= known
