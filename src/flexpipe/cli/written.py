"""One line for every file a command writes, so that nothing lands on disk unannounced:
``wrote clip.txt (the best schedule, as text)``. On stdout, or on stderr when stdout carries
data (``--json``, ``export``'s schedule)."""

from __future__ import annotations

import sys


def announce(path: str, what: str, to_stderr: bool = False) -> None:
    """Say that ``path`` was written and what it holds (on stderr with ``to_stderr``)."""
    from flexpipe.cli.guards import safe

    print(f"wrote {safe(path)} ({what})", file=sys.stderr if to_stderr else sys.stdout,
          flush=True)
