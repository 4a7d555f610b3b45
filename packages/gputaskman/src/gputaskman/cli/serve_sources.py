"""What `gputaskman serve` samples: this machine (the collector, or a ``--sysroot`` tree), or,
for demos and tests, the demo snapshot (``--demo``) or a recording in a loop (``--replay``).

Each is a collector-like object (`prime`, `sample_with_system`, `close`) that the serve
sampler builds on its own thread. The demo and the recording are served as samples taken now,
each carrying a note that says what it is (`recordloop.as_served`), so a fleet of them on
one machine looks like GPU hosts without ever claiming to be a measurement.
"""

from __future__ import annotations

import argparse
from typing import Any

from gputaskman.base.readings import Snapshot
from gputaskman.core import host, report
from gputaskman.core.document import read_document
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.offline.recordloop import RecordLoop, as_served

DEMO_NOTE = "demo: gputaskman.fixtures.demo's synthetic data, not measured"


class DemoSource:
    """The demo snapshot and host sample, as if sampled now."""

    def __init__(self, gpu: int | None = None) -> None:
        self._doc = read_document(report.to_json_dict(demo_snapshot(), DemoSystem(), gpu))

    def prime(self) -> None:
        pass

    def close(self) -> None:
        pass

    def sample_with_system(self) -> tuple[Snapshot, host.SystemInfo | None]:
        return as_served(self._doc, DEMO_NOTE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden source flags (demos and tests; the default samples this machine). Not a
    mutually exclusive group: Python 3.11's argparse fails an assertion formatting the usage
    of a group of hidden options (`serve --listen nope` crashed); `serve` refuses both
    at once itself."""
    parser.add_argument("--demo", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--replay", metavar="FILE", default=None, help=argparse.SUPPRESS)


def source_factory(args: argparse.Namespace) -> Any:
    """A callable that builds the source `args` name (on the sampler's thread). Raises
    OSError or SnapshotError when ``--replay`` names a file that cannot be replayed."""
    from gputaskman.cli import _collector
    from gputaskman.core.collector import SCAN_BUDGET

    gpu = args.gpu
    if args.demo:
        return lambda: DemoSource(gpu)
    replay = args.replay
    if replay:
        loop = RecordLoop(replay)  # opened here: a bad file is a usage error, not a log line
        return lambda: loop
    return lambda: _collector(args, SCAN_BUDGET)
