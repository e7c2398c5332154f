"""Hypothesis profiles, and the suite over two pytest-xdist workers.

``ci`` (the default profile) derives each property test's examples from the test itself, so a
run of the suite is reproducible and a red build names a case every rerun shows; ``explore``
(``HYPOTHESIS_PROFILE=explore``) draws fresh random examples on every run, to hunt for new
counterexamples before a change lands.

``make test`` runs two workers (``-n 2 --dist loadgroup``): most tests are one process on one
core, so the second core would idle. Every test of a module that uses the shared launches
(``tests/runtime/shared_launch.py``) joins one group, run by one worker, so each world's launch
starts once; ``shared_launch.results`` refuses a test outside that group. The summary lists
the launches' parts, gathered from the worker that ran them."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


GROUP = "shared-launch"
"""The xdist group of every test in a module that imports ``shared_launch``."""
_WORKER_SECONDS: dict[str, float] = {}


def _launch_seconds() -> dict[str, float]:
    import sys

    return dict(getattr(sys.modules.get("shared_launch"), "SECONDS", {}))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put every test of a module that uses the shared launches in one xdist group, and tell
    ``shared_launch`` which tests those are."""
    grouped = [item for item in items
               if getattr(getattr(item, "module", None), "shared_launch", None) is not None]
    for item in grouped:
        item.add_marker(pytest.mark.xdist_group(GROUP))
    if grouped:
        grouped[0].module.shared_launch.GROUPED.update(item.nodeid for item in grouped)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand the launches' part seconds to the controller."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["launch_seconds"] = _launch_seconds()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """On the xdist controller: gather a finished worker's launch seconds."""
    _WORKER_SECONDS.update(getattr(node, "workeroutput", {}).get("launch_seconds", {}))


def pytest_terminal_summary(terminalreporter: object) -> None:
    """List the shared launches' parts by wall seconds (rank 0), slowest first, where any ran:
    a part's time is charged to whichever test first asked for its world's results."""
    seconds = {**_launch_seconds(), **_WORKER_SECONDS}
    if not seconds:
        return
    write = terminalreporter.write_line  # type: ignore[attr-defined]
    write("shared launch parts (rank 0 wall seconds):")
    for key, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        write(f"  {value:8.1f}s  {key}")
