"""What the TUI tests share: a collector returning fixed data, and waiting for the first sample."""

from __future__ import annotations

from gputaskman.base.readings import Snapshot
from gputaskman.fixtures.demo import DemoSystem
from gputaskman.tui.app import GtmApp


class Fixed:
    """A collector returning one snapshot and the demo's host sample (synthetic, not measured),
    counting its calls."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.calls = 0

    def sample_with_system(self):
        self.calls += 1
        return self.snapshot, DemoSystem()

    def rescan(self, pid: int, create_time: float | None) -> None:
        return None  # fixed data: nothing to scan

    def close(self) -> None:
        pass


async def settle(pilot, app: GtmApp, steady: bool = False) -> None:
    """Wait for the first sample; `steady`: also hide the wall-clock refresh time, which would
    make a snapshot flaky."""
    for _ in range(200):
        await pilot.pause()
        if app.samples:
            break
        await pilot.pause(0.01)
    else:
        raise AssertionError("no sample arrived")
    if steady:
        app.last_elapsed_s = None
        app.render_status()
        await pilot.pause()
