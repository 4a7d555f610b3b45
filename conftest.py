"""Settings for every test of the workspace.

Hypothesis: a run on a developer's machine draws new examples each time (that is how it finds
bugs); CI runs with HYPOTHESIS_PROFILE=ci, which draws the same examples every run and has no
per-example deadline, so whether a submission lands does not depend on a random draw or on
how loaded the CI machine is. A bug a random local run finds gets an explicit example test.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
