"""The process table with more processes than fit on screen: the cursor keys and clicks move
through all of them, the view follows the cursor, and the columns fit the rows on screen.

The snapshot is the demo's (synthetic GPU numbers) with its first process copied 300 times
under other PIDs and names; only the rows drawn are ever formatted (`line_table`)."""

from __future__ import annotations

import dataclasses

from gputaskman.base.readings import Snapshot
from gputaskman.fixtures.demo import demo_snapshot
from gputaskman.tui.app import create_app
from gputaskman.tui.widgets.process_table import ProcessTable
from tui_support import Fixed, settle

N = 300
LONG = "a-much-longer-name"  # the processes last in VRAM order are called this


def many() -> Snapshot:
    base = demo_snapshot()
    first = base.processes[0]
    rows = []
    for i in range(N):
        vram = dataclasses.replace(first.dedicated, value=(N - i) << 20)  # row i is i-th
        name = LONG if i >= N - 20 else f"w{i}"
        rows.append(dataclasses.replace(first, pid=10_000 + i, name=name, dedicated=vram))
    return dataclasses.replace(base, processes=tuple(rows))


async def test_keys_and_clicks_move_through_every_row_and_the_view_follows():
    app = create_app(collector_factory=lambda: Fixed(many()), interval=60.0)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot, app)
        table = app.query_one(ProcessTable)
        assert table.row_count == N and table.current_key() == table.keys[0]
        on_screen = len(table.visible_range())
        assert 5 < on_screen < N
        await pilot.press("end")
        assert table.cursor_row == N - 1 and N - 1 in table.visible_range()
        assert str(10_000 + N - 1) in str(app.inspector.body.render())  # it follows the cursor
        await pilot.press("pageup")
        assert table.cursor_row == N - 1 - on_screen and table.cursor_row in table.visible_range()
        await pilot.press("home")
        assert table.cursor_row == 0 and table.visible_range().start == 0
        await pilot.press("down", "down", "up")
        assert table.cursor_row == 1
        await pilot.click(table, offset=(5, 4))  # the header is line 0: line 4 is row 3
        assert table.cursor_row == 3 and table.current().pid == 10_003


async def test_the_columns_fit_the_rows_on_screen_and_follow_a_scroll():
    """Catches columns sized once for the first screen: the long names at the end of the table
    would be cut after scrolling to them, though the table has room for them."""
    app = create_app(collector_factory=lambda: Fixed(many()), interval=60.0)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot, app)
        table = app.query_one(ProcessTable)
        name = table.columns_shown.index("NAME")
        assert table.widths[name] == len("NAME")  # w0 .. w26: none wider than the label
        table.scroll_to(y=N, animate=False, immediate=True)  # the wheel, without the cursor
        await pilot.pause()
        await pilot.pause()
        assert table.widths[name] == len(LONG)
        last = table.render_line(table.size.height - 1).text
        assert LONG in last and "…" not in last
        assert table.cursor_row == 0  # scrolling did not move the cursor
