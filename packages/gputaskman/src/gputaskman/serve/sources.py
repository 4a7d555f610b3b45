"""What `gputaskman serve` samples: this machine (the collector `cli.serve` builds, or a
``--sysroot`` tree), or, for demos and tests, the demo snapshot (``--demo``) or a recording in a
loop (``--replay``).

Each is a collector-like object (`prime`, `sample_with_system`, `close`) that the serve
sampler builds on its own thread. The demo and the recording are served as samples taken now,
each carrying a note that says what it is (`recordloop.as_served`), so a fleet of them on
one machine looks like GPU hosts without ever claiming to be a measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gputaskman.base.readings import Snapshot
from gputaskman.document.reader import read_document
from gputaskman.fixtures.demo import NOTE, DemoSystem, demo_snapshot
from gputaskman.offline.recordloop import RecordLoop, as_served
from gputaskman.render import report
from gputaskman.sampling import host

DEMO_NOTE = NOTE  # the demo snapshot's own note: served once, not twice


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


def source_factory(
    live: Callable[[], Any], gpu: int | None = None, demo: bool = False, replay: str | None = None
) -> Callable[[], Any]:
    """A callable that builds the source to serve (on the sampler's thread): the demo, the
    recording `replay` in a loop, or else `live` (this machine's collector). Raises OSError or
    SnapshotError when `replay` names a file that cannot be replayed."""
    if demo:
        return lambda: DemoSource(gpu)
    if replay:
        loop = RecordLoop(replay)  # opened here: a bad file is a usage error, not a log line
        return lambda: loop
    return live
