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
