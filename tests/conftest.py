"""Hypothesis profiles, and the suite over two pytest-xdist workers.

``ci`` (the default profile) derives each property test's examples from the test itself, so a
run of the suite is reproducible and a red build names a case every rerun shows; ``explore``
(``HYPOTHESIS_PROFILE=explore``) draws fresh random examples on every run, to hunt for new
counterexamples before a change lands.

``make test`` runs two workers (``-n 2 --dist loadgroup``): most tests are one process on one
core, so the second core would idle. Every test of a module that uses the shared launches
(``tests/runtime/shared_launch.py``) joins one group, run by one worker, so each world's launch
starts once; ``shared_launch.results`` refuses a test outside that group. Every other module
whose tests share a module-scoped fixture of the suite (a demo run, a launch of its own) joins a
group of its own, so the fixture runs once, not once per worker. The summary lists the
launches' parts, gathered from the worker that ran them."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

os.environ.setdefault("FLEXPIPE_MEMORY", "64GiB")
"""The CLI's size guards read this machine's free memory; the suite states it instead, so a
command's verdict does not depend on what the suite's other launches hold at that moment (the
guards' own tests set their figure)."""

os.environ.setdefault("FLEXPIPE_CACHE_BYTES", "8MiB")
"""The profiler evicts twice the largest cache before every cold pass; this machine reports
its host's 480 MiB, so the suite states a small one: no test reads the times it profiles
(``runtime.measurement.caches``)."""

os.environ.setdefault("OMP_NUM_THREADS", "1")
"""Each worker (and each process a test starts) computes on one thread: the suite runs as many
workers as the machine has cores, and the multi-process launches set one thread per rank. Two
threads per worker gained nothing on this suite's small tensors when the machine was quiet, and
beside one busy process they spun for each other: the in-process Hugging Face splits took 145 s
of CPU instead of 63 s. A test process that imported torch first gets the same."""
if "torch" in sys.modules:
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


GROUP = "shared-launch"
"""The xdist group of every test in a module that imports ``shared_launch``."""
_WORKER_SECONDS: dict[str, float] = {}


def _launch_seconds() -> dict[str, float]:
    import sys

    return dict(getattr(sys.modules.get("shared_launch"), "SECONDS", {}))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture defined in the suite (not a plugin's)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {}) if info is not None else {}
    return any(d.scope == "module" and d.baseid for ds in defs.values() for d in ds)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put every test of a module that uses the shared launches in one xdist group, and tell
    ``shared_launch`` which tests those are; group the tests of any other module by module
    where they share a module-scoped fixture; keep the group a test names itself
    (``pytest.mark.xdist_group(name)``: tests that build the same remembered schedules)."""
    grouped = [item for item in items
               if getattr(getattr(item, "module", None), "shared_launch", None) is not None]
    if grouped:
        grouped[0].module.shared_launch.GROUPED.update(item.nodeid for item in grouped)
    chosen = {id(item) for item in grouped}
    groups = {id(item): GROUP for item in grouped}
    groups.update({id(item): item.nodeid.split("::")[0] for item in items
                   if id(item) not in chosen and _shares_a_module_fixture(item)})
    groups.update({id(item): str(mark.args[0]) for item in items if id(item) not in groups
                   for mark in item.iter_markers("xdist_group") if mark.args})
    for item in items:
        if id(item) in groups:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
            if config.getoption("loadgroup", False):
                _tag(item, groups[id(item)])


def _tag(item: pytest.Item, group: str) -> None:
    """Append ``@group`` to ``item``'s id, which is how pytest-xdist's ``loadgroup``
    scheduler sees a group. pytest-xdist 3.8.0 does it by setting ``item._nodeid``, which
    pytest 9 no longer reads (a node's id is ``item._id``), so without this every group is
    ignored and each worker runs the shared launches again."""
    from _pytest.nodeid import NodeId

    if "@" not in item.nodeid:
        item._id = NodeId.parse(f"{item.nodeid}@{group}")  # type: ignore[attr-defined]


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
