"""A table that draws only the lines on screen: a header line and one line per row, with a
row cursor, zebra stripes and the look of Textual's DataTable (its CSS, renamed).

Why not DataTable: it keeps every row's cells as Rich renderables and renders each visible
cell through Rich's console, so a refresh of a thousand processes costs the formatting of a
thousand rows plus a Rich render per visible cell (most of the TUI's CPU,
`benchmarks/gtm_tui_cost.py`). Here the owner hands over the row keys in order and a function
that gives a row's cells, and `render_line` asks it only for the rows it draws. A cell is a
`str`, written as one plain segment in the row's style, or a Rich `Text` whose own styles
(a coloured bar, a status in red) are laid over the row's, as DataTable lays them: on the
cursor's row the cursor's colour wins. Text from outside (process names, command lines,
model names) is never read as markup either way.

Cells are left-aligned, padded by one column each side, cut by terminal cells (wide
characters count as two) with "…" when wider than their column. Room right of the last
column takes the widget's background, or with `FILL_ROWS` the row's own style (zebra,
cursor, header), as DataTable fills it. The cursor stays on the same row key when the rows
are replaced; the view scrolls to keep it in sight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

PAD = 1  # columns of padding each side of a cell, as DataTable's default
Cell = str | Text
CellsOf = Callable[[str], Sequence[Cell]]


def fit_cell(text: str, width: int) -> str:
    """`text` in exactly `width` terminal cells: padded, or cut with "…"."""
    if cell_len(text) <= width:
        return set_cell_size(text, width)
    if width <= 1:
        return set_cell_size("…", width)
    return set_cell_size(text, width - 1) + "…"


class RowMessage(Message):
    """A message about the row `key` of `table`."""

    def __init__(self, table: LineTable, key: str | None) -> None:
        super().__init__()
        self.table = table
        self.key = key

    @property
    def control(self) -> LineTable:
        return self.table


class LineTable(ScrollView, can_focus=True):
    """Rows of text cells under a header line; see the module docstring."""

    FILL_ROWS: ClassVar[bool] = False  # the row's style right of the last column
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "line-table--header",
        "line-table--cursor",
        "line-table--even-row",
        "line-table--odd-row",
    }
    DEFAULT_CSS = """
    LineTable {
        background: $surface;
        color: $foreground;
        &:focus {
            background-tint: $foreground 5%;
            & > .line-table--cursor {
                background: $block-cursor-background;
                color: $block-cursor-foreground;
                text-style: $block-cursor-text-style;
            }
            & > .line-table--header {
                background-tint: $foreground 5%;
            }
        }
        &:dark > .line-table--even-row {
            background: $surface-darken-1 40%;
        }
        & > .line-table--header {
            text-style: bold;
            background: $panel;
            color: $foreground;
        }
        &:ansi > .line-table--header {
            background: ansi_bright_blue;
            color: ansi_default;
        }
        & > .line-table--even-row {
            background: $surface-lighten-1 50%;
        }
        & > .line-table--cursor {
            background: $block-cursor-blurred-background;
            color: $block-cursor-blurred-foreground;
            text-style: $block-cursor-blurred-text-style;
        }
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("enter", "select_cursor", "select", show=False),
        Binding("up", "cursor_up", "cursor up", show=False),
        Binding("down", "cursor_down", "cursor down", show=False),
        Binding("pageup", "page_up", "page up", show=False),
        Binding("pagedown", "page_down", "page down", show=False),
        Binding("home,ctrl+home", "first", "first row", show=False),
        Binding("end,ctrl+end", "last", "last row", show=False),
        Binding("left", "scroll_left", "scroll left", show=False),
        Binding("right", "scroll_right", "scroll right", show=False),
    ]

    cursor_row: reactive[int] = reactive(0, always_update=False, init=False)

    class RowHighlighted(RowMessage):
        """The cursor moved to another row (or the rows under it changed); `key` is None when
        the table is empty."""

    class RowSelected(RowMessage):
        """Enter (or a click on the highlighted row)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.labels: tuple[str, ...] = ()
        self.widths: tuple[int, ...] = ()  # each column's content width, padding not counted
        self.keys: list[str] = []  # the rows, in order
        self._index: dict[str, int] = {}
        self._cells_of: CellsOf = lambda _key: ()
        self._strips: dict[tuple[str, bool], Strip] = {}  # rows drawn since the last change
        self._styles: dict[str, Style] = {}

    # -- what the owner calls

    def set_rows(self, keys: Sequence[str], keep: str | None = None) -> None:
        """Show the rows `keys` in this order. The cursor goes to `keep` when it is one of
        them (else it keeps its index), and the view scrolls only when the cursor's row
        moved, so a view scrolled away from the cursor stays where it is."""
        self.keys = list(keys)
        self._index = {k: i for i, k in enumerate(self.keys)}
        self._strips.clear()
        self.virtual_size = Size(self.virtual_size.width, len(self.keys) + 1)
        before = self.cursor_row
        row = self._index.get(keep, before) if keep is not None else before
        row = max(0, min(row, len(self.keys) - 1))
        self.set_reactive(LineTable.cursor_row, row)
        if row != before:
            self._scroll_to_cursor()
        self.refresh()
        if self.current_key() != keep:  # another process under the cursor (not just moved)
            self.post_message(self.RowHighlighted(self, self.current_key()))

    def set_columns(self, labels: Sequence[str], widths: Sequence[int], cells_of: CellsOf) -> None:
        """The header `labels`, each column's content `widths`, and `cells_of(key)`: a row's
        cells, asked only for the rows drawn."""
        self.labels, self.widths = tuple(labels), tuple(widths)
        self._cells_of = cells_of
        self._strips.clear()
        width = sum(w + 2 * PAD for w in self.widths)
        self.virtual_size = Size(width, len(self.keys) + 1)
        self.refresh()

    def redraw(self) -> None:
        """Draw the rows again (their cells changed, the keys did not)."""
        self._strips.clear()
        self.refresh()

    @property
    def row_count(self) -> int:
        return len(self.keys)

    def current_key(self) -> str | None:
        if 0 <= self.cursor_row < len(self.keys):
            return self.keys[self.cursor_row]
        return None

    def row_index(self, key: str) -> int:
        return self._index[key]

    def move_cursor(self, row: int) -> None:
        self.cursor_row = max(0, min(row, len(self.keys) - 1))

    def visible_range(self) -> range:
        """The indices of the rows on screen (the header line takes one)."""
        top = int(self.scroll_offset.y)
        return range(top, min(len(self.keys), top + self._rows_on_screen()))

    def _rows_on_screen(self) -> int:
        return max(1, self.scrollable_content_region.height - 1)

    # -- cursor and scrolling

    def watch_cursor_row(self, old: int, new: int) -> None:
        for k in (old, new):
            if 0 <= k < len(self.keys):
                self._strips.pop((self.keys[k], True), None)
                self._strips.pop((self.keys[k], False), None)
        self._scroll_to_cursor()
        self.refresh()
        self.post_message(self.RowHighlighted(self, self.current_key()))

    def _scroll_to_cursor(self) -> None:
        rows = self._rows_on_screen()
        top = int(self.scroll_offset.y)
        row = self.cursor_row
        if row < top:
            self.scroll_to(y=row, animate=False, immediate=True)
        elif row >= top + rows:
            self.scroll_to(y=row - rows + 1, animate=False, immediate=True)

    def action_cursor_up(self) -> None:
        self.move_cursor(self.cursor_row - 1)

    def action_cursor_down(self) -> None:
        self.move_cursor(self.cursor_row + 1)

    def action_page_up(self) -> None:
        self.move_cursor(self.cursor_row - self._rows_on_screen())

    def action_page_down(self) -> None:
        self.move_cursor(self.cursor_row + self._rows_on_screen())

    def action_first(self) -> None:
        self.move_cursor(0)

    def action_last(self) -> None:
        self.move_cursor(len(self.keys) - 1)

    def action_select_cursor(self) -> None:
        key = self.current_key()
        if key is not None:
            self.post_message(self.RowSelected(self, key))

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None or offset.y < 1:
            return
        row = int(self.scroll_offset.y) + offset.y - 1
        if row >= len(self.keys):
            return
        if row == self.cursor_row:
            self.action_select_cursor()
        else:
            self.move_cursor(row)

    def on_resize(self, _event: events.Resize) -> None:
        self._scroll_to_cursor()

    # -- drawing

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles.clear()
        self._strips.clear()

    def _style(self, name: str) -> Style:
        style = self._styles.get(name)
        if style is None:
            style = self._styles[name] = self.get_component_rich_style(name)
        return style

    def _line(self, cells: Sequence[Cell], style: Style, cursor: bool = False) -> Strip:
        pad = " " * PAD
        segments: list[Segment] = []
        plain = ""  # the str cells since the last Text cell: one segment
        for cell, width in zip(cells, self.widths, strict=False):
            if isinstance(cell, str):
                plain += pad + fit_cell(cell, width) + pad
                continue
            segments.append(Segment(plain + pad, style))
            segments += self._styled(cell, width, style, cursor)
            plain = pad
        if plain:
            segments.append(Segment(plain, style))
        return Strip(segments, sum(w + 2 * PAD for w in self.widths[: len(cells)]))

    def _styled(self, text: Text, width: int, style: Style, cursor: bool) -> list[Segment]:
        """A Text cell in `width` cells: its styles over the row's `style` (on the cursor's
        row the cursor's foreground over both, as DataTable draws it), padded in `style`."""
        size = cell_len(text.plain)
        if size > width:
            text = text.copy()
            text.truncate(width, overflow="ellipsis")
            size = width
        console = self.app.console
        # Text.render leaves the text's own style out when it has no spans: added here
        under = style + console.get_style(text.style, default=Style.null())
        over = Style.from_color(self._style("line-table--cursor").color) if cursor else None
        out = [Segment(s.text, under + s.style + over) for s in text.render(console)]
        if size < width:
            out.append(Segment(" " * (width - size), style))
        return out

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        scroll_x, scroll_y = self.scroll_offset
        base = self.rich_style
        if y == 0:
            style = base + self._style("line-table--header")
            strip = self._line(self.labels, style)
        else:
            i = int(scroll_y) + y - 1
            if i >= len(self.keys):
                return Strip.blank(width, base)
            key, cursor = self.keys[i], i == self.cursor_row
            style = base + self._style("line-table--odd-row" if i % 2 else "line-table--even-row")
            if cursor:
                style += self._style("line-table--cursor")
            strip = self._strips.get((key, cursor))
            if strip is None:
                cells = self._cells_of(key)
                strip = self._strips[(key, cursor)] = self._line(cells, style, cursor)
        fill = style if self.FILL_ROWS else base
        return strip.crop(int(scroll_x), int(scroll_x) + width).extend_cell_length(width, fill)
