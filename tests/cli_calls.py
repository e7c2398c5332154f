"""What the command-line tests share: a plain terminal (no colour, 100 columns) and ``call``,
which runs ``flexpipe`` in-process and returns its exit code, stdout and stderr."""

from __future__ import annotations

import pytest

from flexpipe.cli.main import main


@pytest.fixture
def plain_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """No colour and 100 columns, so printed output is the same on every machine."""
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "100")


def call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``flexpipe *argv`` in this process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err
