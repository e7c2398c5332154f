"""Hypothesis profiles. ``ci`` (the default) derives each property test's examples from the test
itself, so a run of the suite is reproducible and a red build names a case every rerun shows;
``explore`` (``HYPOTHESIS_PROFILE=explore``) draws fresh random examples on every run, to hunt
for new counterexamples before a change lands."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: object) -> None:
    """List the shared launches' parts by wall seconds (rank 0), slowest first, where any ran:
    a part's time is charged to whichever test first asked for its world's results."""
    import sys

    launch = sys.modules.get("shared_launch")
    seconds = getattr(launch, "SECONDS", {})
    if not seconds:
        return
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write("shared launch parts (rank 0 wall seconds):")
    for key, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        write(f"  {value:8.1f}s  {key}")
