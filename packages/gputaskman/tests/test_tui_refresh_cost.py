"""What the TUI leaves out on a refresh, for its cost at 1 Hz (benchmarks/gtm_tui_cost.py),
shows the same: column widths as DataTable's own measuring gives them, and panels whose
content did not change left as they are."""

from __future__ import annotations

import pytest
from gputaskman.tui.widgets.process_table import ProcessTable
from gputaskman.tui.widgets.unchanged import same_content, update_static
from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import DataTable, Static

COLS = ("PID", "NAME")


class Tables(App):
    def compose(self) -> ComposeResult:
        yield ProcessTable()
        yield DataTable(id="plain")
        yield Static("", id="s")


def rows(cells: dict[str, tuple[str, str]]) -> dict:
    return {k: (None, c) for k, c in cells.items()}


# (first cells, next cells, NAME's width after): a grown cell narrower than the column makes
# DataTable measure the column again (it shrinks to its widest cell); wider ones widen it.
CASES = [
    ({"a": ("1", "aaaaaa"), "b": ("2", "bb")}, {"a": ("1", "a"), "b": ("2", "bbb")}, 4),
    ({"a": ("1", "aaaaaa"), "b": ("2", "bb")}, {"a": ("1", "a"), "b": ("2", "b" * 9)}, 9),
    ({"a": ("1", "aaaaaa"), "b": ("2", "bb")}, {"a": ("1", "aaaaaa"), "b": ("2", "b")}, 6),
]


@pytest.mark.parametrize(("first", "after", "width"), CASES)
async def test_grown_cells_size_columns_as_update_cell_does(first, after, width):
    app = Tables()
    async with app.run_test() as pilot:
        table, plain = app.query_one(ProcessTable), app.query_one("#plain", DataTable)
        table._set_columns(COLS)
        for c in COLS:
            plain.add_column(c, key=c)
        for k, cells in first.items():
            plain.add_row(*(Text(c) for c in cells), key=k)
        table._reconcile(rows(first), COLS)
        await pilot.pause()
        for k, cells in after.items():  # what DataTable's own update path does
            for col, old, new in zip(COLS, first[k], cells, strict=True):
                if old != new:
                    plain.update_cell(k, col, Text(new), update_width=len(new) > len(old))
        table._reconcile(rows(after), COLS)
        assert not table._updated_cells  # no per-cell measuring queued for DataTable's idle
        await pilot.pause()
        want = [plain.columns[c].content_width for c in plain.columns]
        assert [table.columns[c].content_width for c in table.columns] == want
        assert want[1] == max(width, len("NAME"))


async def test_a_refresh_that_widens_nothing_asks_no_new_layout():
    app = Tables()
    async with app.run_test() as pilot:
        table = app.query_one(ProcessTable)
        table._set_columns(COLS)
        table._reconcile(rows({"a": ("1", "aaaaaa"), "b": ("2", "bb")}), COLS)
        await pilot.pause()
        assert not table._require_update_dimensions
        table._reconcile(rows({"a": ("1", "aaaaaa"), "b": ("2", "bbb")}), COLS)
        assert not table._require_update_dimensions  # bbb grew, NAME is as wide as before
        table._reconcile(rows({"a": ("1", "aaaaaa"), "b": ("2", "bbbbbb")}), COLS)
        assert not table._require_update_dimensions  # as wide as NAME already was
        table._reconcile(rows({"a": ("1", "aaaaaa"), "b": ("2", "b" * 9)}), COLS)
        assert table._require_update_dimensions  # NAME widened: the table's size changes


def test_same_content_compares_everything_that_renders():
    assert same_content("x", "x") and not same_content("x", "y")
    assert same_content(Text("ab", style="bold"), Text("ab", style="bold"))
    assert not same_content(Text("ab"), Text("ab", style="bold"))
    assert not same_content(Text("ab"), Text.assemble("a", ("b", "red")))
    assert not same_content(Text("ab"), Text("ab", justify="right"))
    assert not same_content(Text("ab"), Text("ab", no_wrap=True))
    assert not same_content("ab", Text("ab"))


async def test_an_identical_update_is_left_out_a_changed_one_shown():
    app = Tables()
    async with app.run_test() as pilot:
        static = app.query_one("#s", Static)
        first = Text("GPU 0 [mapped✓]")
        update_static(static, first)
        await pilot.pause()
        update_static(static, Text("GPU 0 [mapped✓]"))
        assert static.content is first  # the widget was not updated
        changed = Text("GPU 0 [mapped✓]", style="bold")
        update_static(static, changed)
        assert static.content is changed
        await pilot.pause()
        assert str(static.render()) == "GPU 0 [mapped✓]"
