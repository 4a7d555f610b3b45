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
Rows are keyed by host and GPU address, so the cursor stays on the same GPU across refreshes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from gputaskman.base.fmt import fmt_reading
from gputaskman.core.fleetdoc import HostStatus
from gputaskman.fleet.view import COLUMNS, FleetRow, sorted_rows, util_text
from gputaskman.tui.widgets.gpu_header import memory_cell

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


def memory(row: FleetRow, bar: int) -> Text:
    """The MEMORY cell: a bar `bar` cells wide and the numbers, or n/a with the reason."""
    if row.adapter is None:
        return Text("")
    used, total = row.memory_used, row.memory_total
    if used is None or total is None:
        return Text("n/a (no metrics)", style="yellow")
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


class FleetTable(DataTable):
    DEFAULT_CSS = """
    FleetTable { height: 1fr; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_column = "HOST"
        self.descending = False
        self.rows_shown: dict[str, FleetRow] = {}
        self.widths: dict[str, int] = {}

    def header_label(self, column: str) -> str:
        if SORT_ON[self.sort_column] != column:
            return column
        mark = SORT_MARKS[0] if self.descending else SORT_MARKS[1]
        return f"{column} %{mark}" if self.sort_column == "MEM%" else f"{column} {mark}"

    def show(self, rows: Sequence[FleetRow], width: int) -> None:
        """Replace the rows, keeping the cursor on the same host and GPU."""
        keep = self.current_key()
        widths = fit(width)
        if widths != self.widths:
            self.clear(columns=True)
            for c, w in widths.items():
                self.add_column(self.header_label(c), key=c, width=w)
            self.widths = widths
        else:
            self.clear()
            for key, col in self.columns.items():
                col.label = Text(self.header_label(str(key.value)))
        self.rows_shown = {}
        prev_host = None
        texts = [len(t) for r in rows if (t := _memory_text(r)) is not None]
        bar = max(0, widths["MEMORY"] - max(texts, default=0))  # one bar length for all rows
        for r in sorted_rows(rows, self.sort_column, self.descending):
            self.rows_shown[r.key] = r
            host = Text(_cut_start(r.host, widths["HOST"]) if r.host != prev_host else "")
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
                    "GPU": Text(_cut(r.gpu, widths["GPU"])),
                    "MEMORY": memory(r, bar),
                    "UTIL": Text(util_text(r)),
                    "PROCESSES": Text(_cut(r.processes, widths.get("PROCESSES", 0))),
                    "MODELS": Text(_cut(r.models, widths.get("MODELS", 0))),
                }
            # Text, not str: host names, process and model names come from the hosts and
            # must show as sent, never be read as markup ("[mapped✓]", "[::1]:9835")
            self.add_row(*(cells[c] for c in widths), key=r.key)
            prev_host = r.host
        self._require_update_dimensions = True
        self.refresh()
        if keep is not None and keep in self.rows_shown:
            self.move_cursor(row=self.get_row_index(keep))

    def current_key(self) -> str | None:
        if not self.rows_shown or not 0 <= self.cursor_row < self.row_count:
            return None
        try:
            return str(self.coordinate_to_cell_key((self.cursor_row, 0)).row_key.value)
        except Exception:  # no row under the cursor
            return None

    def current(self) -> FleetRow | None:
        k = self.current_key()
        return None if k is None else self.rows_shown.get(k)
