"""What the TUI leaves out on a refresh, for its cost at 1 Hz (benchmarks/gtm_tui_cost.py):
rows that are not drawn are not formatted, and panels whose content did not change are left
as they are; what is shown stays the same."""

from __future__ import annotations

from gputaskman.tui.widgets.line_table import LineTable
from gputaskman.tui.widgets.unchanged import same_content, update_static
from rich.color import Color
from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.widgets import Static


class Tables(App):
    def __init__(self) -> None:
        super().__init__()
        self.highlighted: list[str | None] = []

    def compose(self) -> ComposeResult:
        yield LineTable()
        yield Static("", id="s")

    @on(LineTable.RowHighlighted)
    def _highlighted(self, event: LineTable.RowHighlighted) -> None:
        self.highlighted.append(event.key)


def numbered(n: int, wide: int | None = None) -> dict[str, tuple[str, str]]:
    """Rows r0.. with a NAME as long as its number; row `wide` has a 30-cell name."""
    return {f"r{i}": (str(i), "x" * 30 if i == wide else f"n{i}") for i in range(n)}


async def test_only_the_rows_drawn_are_asked_for_and_wide_cells_are_cut():
    """Catches a table that formats every row on each refresh (with 1,000 processes that was
    most of the TUI's CPU), and a cell wider than its column that pushes the next one."""
    app = Tables()
    async with app.run_test(size=(40, 12)) as pilot:
        table = app.query_one(LineTable)
        rows = numbered(1000, wide=500)
        asked: list[str] = []

        def cells_of(key: str) -> tuple[str, str]:
            asked.append(key)
            return rows[key]

        table.set_rows(list(rows))
        table.set_columns(("PID", "NAME"), (3, 4), cells_of)
        await pilot.pause()
        on_screen = len(table.visible_range())
        assert 0 < on_screen < 12 and set(asked) == {f"r{i}" for i in range(on_screen)}
        line = table.render_line(1).text
        assert line.startswith(" 0    n0  ") and "x" not in line
        asked.clear()
        table.move_cursor(500)  # the view follows the cursor: the wide row is drawn now
        await pilot.pause()
        assert "r500" in asked and len(set(asked)) <= on_screen
        assert table.visible_range().start <= 500 < table.visible_range().stop
        cut = table.render_line(500 - table.visible_range().start + 1).text
        assert " xxx" in cut and "…" in cut  # wider than its column: cut, not wrapped


async def test_the_cursor_keeps_its_row_and_the_view_stays_where_the_user_scrolled():
    """Catches a refresh that moves the cursor to another process when the rows reorder, one
    that says the highlighted row changed when only its place did (the inspector was drawn
    twice each refresh), and one that scrolls a view the user moved away from the cursor back
    to it every second."""
    app = Tables()
    async with app.run_test(size=(40, 12)) as pilot:
        table = app.query_one(LineTable)
        rows = numbered(100)
        table.set_rows(list(rows))
        table.set_columns(("PID", "NAME"), (3, 4), lambda k: rows[k])
        table.move_cursor(3)
        await pilot.pause()
        app.highlighted.clear()
        table.set_rows(list(reversed(rows)), keep="r3")  # the rows reordered
        assert table.current_key() == "r3" and table.cursor_row == 96
        await pilot.pause()
        assert app.highlighted == []  # the same process: the inspector needs no new render
        assert 96 in table.visible_range()  # the cursor moved: the view followed it
        table.scroll_to(y=10, animate=False, immediate=True)  # the user scrolls away
        await pilot.pause()
        table.set_rows(list(reversed(rows)), keep="r3")  # the same order again
        await pilot.pause()
        assert table.visible_range().start == 10 and table.current_key() == "r3"


async def test_text_from_outside_is_drawn_as_typed():
    """Catches cells read as Rich markup: a process named "[bold]x[/bold]" or a model's
    evidence marker "[mapped✓]" must show literally."""
    app = Tables()
    async with app.run_test(size=(60, 6)) as pilot:
        table = app.query_one(LineTable)
        table.set_rows(["a"])
        table.set_columns(("NAME", "MODEL"), (14, 20), lambda _k: ("[bold]x[/bold]", "q [mapped✓]"))
        await pilot.pause()
        assert table.render_line(1).text.startswith(" [bold]x[/bold]  q [mapped✓] ")


async def test_a_text_cell_is_drawn_in_its_colours_and_the_cursor_colour_wins_on_its_row():
    """Catches a Text cell drawn without its own style (Rich's Text.render leaves it out when
    the text has no spans: a down host's status lost its red), a coloured cell that is not
    cut to its column, and one that keeps its colour on the highlighted row (the cursor's
    colour wins there, as in DataTable)."""
    app = Tables()
    async with app.run_test(size=(40, 6)) as pilot:
        table = app.query_one(LineTable)
        cells = {
            "a": ("x", Text("unreachable", style="red")),
            "b": ("y", Text.assemble(("██", "green"), " 5%")),
        }
        table.set_rows(["a", "b"])
        table.set_columns(("K", "V"), (1, 6), lambda k: cells[k])
        table.move_cursor(1)
        await pilot.pause()

        def color_of(y: int, text: str) -> Color | None:
            return next(s.style for s in table.render_line(y) if text in s.text).color

        assert table.render_line(1).text.startswith(" x  unrea…  ")
        assert color_of(1, "unrea…") == Color.parse("red")
        assert table.render_line(2).text.startswith(" y  ██ 5%  ")
        cursor = table.get_component_rich_style("line-table--cursor").color
        assert color_of(2, "██") == cursor != Color.parse("green")


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


async def test_an_update_that_keeps_the_panel_size_lays_nothing_out():
    """Catches every panel update laying the whole screen out (the inspector's and the status
    line's, each second, were much of the TUI's CPU), and an update that changes the panel's
    height without a layout (its new lines would be cut off)."""
    app = Tables()
    async with app.run_test(size=(40, 12)) as pilot:
        static = app.query_one("#s", Static)
        update_static(static, Text("one\ntwo"))
        await pilot.pause()
        layouts: list[bool] = []
        real = static.refresh

        def refresh(*args, **kwargs):
            layouts.append(kwargs.get("layout", False))
            return real(*args, **kwargs)

        static.refresh = refresh  # type: ignore[method-assign]
        update_static(static, Text("uno\ndos"))
        assert layouts and not any(layouts)  # redrawn, not laid out
        layouts.clear()
        update_static(static, Text("1\n2\n3"))
        assert any(layouts)
        await pilot.pause()
        assert static.size.height == 3
        layouts.clear()
        update_static(static, Text("x" * 60 + "\n2\n3"))  # wraps at 40 columns: 4 lines
        assert any(layouts)
        await pilot.pause()
        assert static.size.height == 4
