"""Settings for every test of the workspace.

Hypothesis: a run on a developer's machine draws new examples each time (that is how it finds
bugs); CI runs with HYPOTHESIS_PROFILE=ci, which draws the same examples every run and has no
per-example deadline, so whether a submission lands does not depend on a random draw or on
how loaded the CI machine is. A bug a random local run finds gets an explicit example test.

SIGINT: a shell without job control starts a background command (`.ci/run &`, nohup) with
SIGINT ignored, every program it starts inherits that, and a Python started so never turns
Ctrl-C into KeyboardInterrupt. The tests that press Ctrl-C on a program they start (`--watch`,
bench_swap) then waited in vain: the run gets Python's own handler back, so the programs it
starts see SIGINT as at a terminal.
"""

from __future__ import annotations

import os
import signal

from hypothesis import settings

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
