"""The fleet table: one row per host and GPU (`fleet.view.FleetRow`), sorted and fitted to the
screen's width.

Cells: the host (on its first row only), the GPU's index and name, a memory bar with used /
total and the share used (each value with its provenance mark; n/a with the reason instead of
an empty bar), utilisation, the processes holding the most memory on that GPU, and the
models held there with their evidence tags. A host that is not up has one row that reads its
status and reason across the columns after HOST (`flow`), coloured by how bad it is, and no
number at all.

Fitting: every column has a narrowest and a widest useful width (`MIN`, `MAX`); PROCESSES and
then MODELS are left out when even the narrowest widths do not fit, and the room left is
shared out in proportion to how much each column can grow (what rounding leaves, in `GROW`
order), up to each widest width. Text that does not fit is cut with "…"
(a host name at its start, where a cluster's names are alike).

Drawing: the table is a `LineTable`, which asks for a row's cells only when it draws that row.
A refresh (`show`) sorts every row and formats every GPU's memory numbers (all bars are one
length, what the widest numbers leave); a row's cells, Rich `Text` where they are coloured,
are built the first time the row is drawn after a refresh and kept until the next one, so a
refresh of 2,000 rows builds a screenful (`rows_built` counts them). Rows are keyed by host
and GPU address, so the cursor stays on the same GPU across refreshes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text

from gputaskman.base.fmt import fmt_reading
from gputaskman.document.fleetdoc import HostStatus
from gputaskman.fleet.view import COLUMNS, FleetRow, sorted_rows, util_text
from gputaskman.tui.widgets.gpu_header import memory_cell
from gputaskman.tui.widgets.line_table import Cell, LineTable

SORT_MARKS = ("▼", "▲")
MIN = {"HOST": 12, "GPU": 12, "MEMORY": 18, "UTIL": 4, "PROCESSES": 14, "MODELS": 14}
MAX = {"HOST": 18, "GPU": 34, "MEMORY": 36, "UTIL": 5, "PROCESSES": 48, "MODELS": 44}
GROW = ("GPU", "MODELS", "HOST", "PROCESSES", "MEMORY")
DROP = ("PROCESSES", "MODELS")  # left out first when the narrowest widths do not fit
CELL_PAD = 2
SCROLLBAR = 2
FLOW_MIN = 8  # narrower columns are skipped when a host row's words run across the cells
STATUS_STYLE = {
    HostStatus.WAITING: "dim",
    HostStatus.STARTING: "yellow",
    HostStatus.SLOW: "yellow",
    HostStatus.UNREACHABLE: "red",
    HostStatus.REFUSED: "red",
    HostStatus.INCOMPATIBLE: "red",
    HostStatus.ERROR: "red",
}
# the column a sort is shown on, and how its label says so
SORT_ON = {"HOST": "HOST", "MEMORY": "MEMORY", "MEM%": "MEMORY", "UTIL": "UTIL"}


def fit(width: int) -> dict[str, int]:
    """Column -> width for a table `width` cells wide (see the module docstring)."""
    cols = list(COLUMNS)
    for drop in DROP:
        if sum(MIN[c] + CELL_PAD for c in cols) + SCROLLBAR <= width:
            break
        cols.remove(drop)
    widths = {c: MIN[c] for c in cols}
    room = width - SCROLLBAR - sum(w + CELL_PAD for w in widths.values())
    span = sum(MAX[c] - MIN[c] for c in cols)
    if room > 0 and span:
        share = min(1.0, room / span)  # each column grows by the same share of its range
        for c in cols:
            extra = int((MAX[c] - MIN[c]) * share)
            widths[c] += extra
            room -= extra
    for c in GROW:  # what rounding left over
        if c in widths and room > 0:
            extra = min(room, MAX[c] - widths[c])
            widths[c] += extra
            room -= extra
    return widths


def flow(text: str, widths: Sequence[int]) -> list[str]:
    """`text` laid across cells of `widths`, word by word, as if they were one wide cell
    (a host row's status reads on across the GPU, MEMORY, ... columns); the last is cut."""
    out: list[str] = []
    words = text.split(" ")
    last = max((i for i, w in enumerate(widths) if w >= FLOW_MIN), default=len(widths) - 1)
    for i, w in enumerate(widths):
        line = ""
        if w < FLOW_MIN and i != last:  # a column too narrow to read words in: left blank
            out.append("")
            continue
        while words and len(line) + bool(line) + len(words[0]) <= w:
            line += (" " if line else "") + words.pop(0)
        if not line and words:  # one word longer than the cell: split it
            line, words[0] = words[0][:w], words[0][w:]
        if i == last and words:
            line = _cut(" ".join([line, *words]).strip(), w)
            words = []
        out.append(line)
    return out


def _cut_start(text: str, n: int) -> str:
    """A host name cut at its start: hosts of a cluster differ at the end (gpu-node-17)."""
    return text if len(text) <= n else "…" + text[len(text) - n + 1 :]


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(1, n - 1)] + "…"


def _memory_text(row: FleetRow) -> str | None:
    """The numbers after the bar, the unit once when both share it: `` 12.0/16.0 GiB 75%``
    (None: no bar to draw on this row)."""
    used, total = row.memory_used, row.memory_total
    if row.adapter is None or used is None or total is None:
        return None
    if used.value is None or total.value is None or not total.value:
        return None
    u, t = fmt_reading(used, as_bytes=True), fmt_reading(total, as_bytes=True)
    unit = t.rsplit(" ", 1)[-1]
    if u.endswith(" " + unit):
        u = u[: -len(unit) - 1]
    return f" {u}/{t} {used.value / total.value:.0%}"


def memory(row: FleetRow, bar: int, text: str | None = None) -> Text:
    """The MEMORY cell: a bar `bar` cells wide and the numbers (`text`: `_memory_text(row)`
    when already made), or n/a with the reason."""
    if row.adapter is None:
        return Text("")
    used, total = row.memory_used, row.memory_total
    if used is None or total is None:
        return Text("n/a (no metrics)", style="yellow")
    if text is None:
        text = _memory_text(row)
    if text is None:
        return memory_cell(used, total, 0)  # n/a with the reason
    frac = max(0.0, min(1.0, float(used.value) / float(total.value)))  # type: ignore[arg-type]
    filled = round(frac * bar)
    style = "green" if frac < 0.75 else "yellow" if frac < 0.9 else "red"
    out = Text("█" * filled, style=style)
    out.append("░" * (bar - filled), style="grey37")
    out.append(text)
    return out


class FleetTable(LineTable):
    """The fleet's rows, sorted in full on each `show`, their cells built only where drawn."""

    DEFAULT_CSS = """
    FleetTable { height: 1fr; }
    """
    FILL_ROWS = True  # the header, zebra stripes and cursor run to the right edge

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sort_column = "HOST"
        self.descending = False
        self.rows_shown: dict[str, FleetRow] = {}  # in the order shown
        self.fitted: dict[str, int] = {}  # column -> content width (`fit`)
        self.rows_built = 0  # rows whose cells were built since the last `show` (tests read it)
        self._bar = 0  # the memory bar's length, one for all rows
        self._numbers: dict[str, str | None] = {}  # row key -> `_memory_text`
        self._built: dict[str, tuple[Cell, ...]] = {}

    def header_label(self, column: str) -> str:
        if SORT_ON[self.sort_column] != column:
            return column
        mark = SORT_MARKS[0] if self.descending else SORT_MARKS[1]
        return f"{column} %{mark}" if self.sort_column == "MEM%" else f"{column} {mark}"

    def show(self, rows: Sequence[FleetRow], width: int) -> None:
        """Replace the rows, keeping the cursor on the same host and GPU; `width` is the
        table's room in cells (the columns are fitted to it)."""
        keep = self.current_key()
        widths = self.fitted = fit(width)
        shown: dict[str, FleetRow] = {}
        for r in sorted_rows(rows, self.sort_column, self.descending):
            shown.setdefault(r.key, r)
        self.rows_shown = shown
        # every row's numbers, not only the drawn ones': the bars line up down the whole table
        self._numbers = {k: _memory_text(r) for k, r in shown.items()}
        longest = max((len(t) for t in self._numbers.values() if t is not None), default=0)
        self._bar = max(0, widths["MEMORY"] - longest)
        self._built = {}
        self.rows_built = 0
        self.set_rows(list(shown), keep)
        labels = [self.header_label(c) for c in widths]
        self.set_columns(labels, list(widths.values()), self.get_row)

    def get_row(self, key: str) -> tuple[Cell, ...]:
        """Row `key`'s cells in the columns shown, built on the first ask after `show`."""
        cells = self._built.get(key)
        if cells is None:
            cells = self._built[key] = self._cells(key)
            self.rows_built += 1
        return cells

    def _cells(self, key: str) -> tuple[Cell, ...]:
        r, widths = self.rows_shown[key], self.fitted
        i = self.row_index(key)
        first = i == 0 or self.rows_shown[self.keys[i - 1]].host != r.host
        host = _cut_start(r.host, widths["HOST"]) if first else ""  # on its first row only
        # str cells are drawn as typed, never as markup: host, process and model names come
        # from the hosts ("[mapped✓]", "[::1]:9835"); Text where a cell is coloured
        cells: dict[str, Cell]
        if r.adapter is None:  # a row about the host: its words run on across the cells
            style = STATUS_STYLE.get(r.status, "")
            rest = [c for c in widths if c != "HOST"]
            parts = flow(r.gpu, [widths[c] for c in rest])
            cells = {"HOST": host} | {
                c: Text(t, style=style) for c, t in zip(rest, parts, strict=True)
            }
        else:
            cells = {
                "HOST": host,
                "GPU": _cut(r.gpu, widths["GPU"]),
                "MEMORY": memory(r, self._bar, self._numbers.get(key)),
                "UTIL": util_text(r),
                "PROCESSES": _cut(r.processes, widths.get("PROCESSES", 0)),
                "MODELS": _cut(r.models, widths.get("MODELS", 0)),
            }
        return tuple(cells[c] for c in widths)

    def current(self) -> FleetRow | None:
        k = self.current_key()
        return None if k is None else self.rows_shown.get(k)
