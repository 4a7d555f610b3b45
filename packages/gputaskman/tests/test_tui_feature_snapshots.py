"""SVG snapshots of the TUI's features as a user sees them: the filter box narrowing the table,
the tree of processes under their parents, the signal confirmation, and a focused second GPU.
Data: the demo snapshot (synthetic, not measured); the host sample is the demo's."""

from __future__ import annotations

import pytest
from gputaskman.fixtures.demo import demo_snapshot
from gputaskman.tui.app import create_app
from tui_support import Fixed, settle

SIZES = [(80, 24), (120, 40)]


@pytest.mark.parametrize(
    "keys",
    [("slash", *"llama"), ("slash", *"llama", "enter"), ("t",), ("k",), ("g",)],
    ids=["filter-typing", "filter-kept", "tree", "signal", "second-gpu"],
)
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_feature_snapshots(snap_compare, utc, size, keys):
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), interval=60.0)

    async def run_before(pilot) -> None:
        await settle(pilot, app, steady=True)
        for k in keys:
            await pilot.press(k)
        await pilot.pause()
        app.render_status()
        await pilot.pause()

    assert snap_compare(app, terminal_size=size, run_before=run_before)
