"""The sortable process table.

Rows are `ProcGpu` entries of the selected adapter plus runtime candidates with no GPU
context. VRAM cells show `shown_vram` with its provenance marker (display and sorting
only); unknown is n/a, sorted after every known value whichever the direction. Rows are
keyed by ``pid@adapter`` so the cursor stays on the same process across refreshes.

A PAGED column (Windows non-local / macOS compressed graphics memory) appears after VRAM
only while some row has a paged reading (`text_report.process_columns`); the columns are
rebuilt when that changes, never on an ordinary refresh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from gputaskman.base.readings import ProcGpu, Reading
from gputaskman.core import report, text_report
from gputaskman.core.host import HostSample

# column label, sort name (None: not a sort column)
COLUMNS = text_report.PROCESS_COLUMNS
SORTS = ("VRAM", "PAGED", "RAM", "CPU%", "PID", "NAME")
# Shown after the sort column's label: (descending, ascending).
SORT_MARKS = ("▼", "▲")


# Widest a text cell may be in the table; the inspector shows the full value.
CELL_LIMITS = {"RUNTIMES": 22, "MODEL": 24, "NAME": 18, "CATEGORY": 16}


def clip(cells: tuple[str, ...], columns: tuple[str, ...] = COLUMNS) -> tuple[str, ...]:
    out = []
    for label, cell in zip(columns, cells, strict=True):
        limit = CELL_LIMITS.get(label)
        if limit is None or len(cell) <= limit:
            out.append(cell)
        elif label == "MODEL" and " [" in cell:
            # shorten the name, never the evidence marker ("[api✓]") after it
            name, tag = cell.rsplit(" [", 1)
            keep = max(1, limit - len(tag) - 3)
            out.append(f"{name[: keep - 1]}… [{tag}")
        else:
            out.append(cell[: limit - 1] + "…")
    return tuple(out)


def row_key(p: ProcGpu) -> str:
    return f"{p.pid}@{p.adapter or '-'}"


def _num(r: Reading | None) -> float | None:
    return None if r is None or r.value is None else float(r.value)


def sort_value(p: ProcGpu, column: str, host: Mapping[str, Reading]) -> tuple[int, Any]:
    """(unknown flag, value): unknown values carry flag 1 so they can be put last."""
    if column == "VRAM":
        v = _num(p.shown_vram)
    elif column == "PAGED":
        v = _num(p.paged)
    elif column == "RAM":
        v = _num(host.get("ram_bytes"))
    elif column == "CPU%":
        v = _num(host.get("cpu_percent"))
    elif column == "PID":
        return (0, p.pid)
    else:
        return (0 if p.name else 1, (p.name or "").lower())
    return (1, 0.0) if v is None else (0, v)


def sorted_rows(
    rows: list[ProcGpu],
    column: str,
    descending: bool,
    lookup: Callable[[int, float | None], Mapping[str, Reading]],
) -> list[ProcGpu]:
    keyed = [(sort_value(p, column, lookup(p.pid, p.create_time) or {}), p) for p in rows]
    known = [x for x in keyed if x[0][0] == 0]
    unknown = [x for x in keyed if x[0][0] == 1]
    known.sort(key=lambda x: (x[0][1], x[1].pid), reverse=descending)
    unknown.sort(key=lambda x: x[1].pid)
    return [p for _, p in known + unknown]


class ProcessTable(DataTable):
    DEFAULT_CSS = """
    ProcessTable { height: 1fr; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.sort_column = "VRAM"
        self.descending = True
        self.rows_shown: dict[str, ProcGpu] = {}
        self.columns_shown: tuple[str, ...] = COLUMNS

    def on_mount(self) -> None:
        for label in self.columns_shown:
            self.add_column(label, key=label)

    def _set_columns(self, columns: tuple[str, ...]) -> None:
        """Rebuild the columns (only when the PAGED column comes or goes)."""
        if columns == self.columns_shown:
            return
        self.clear(columns=True)
        self.columns_shown = columns
        for label in columns:
            self.add_column(label, key=label)
        if self.sort_column not in columns:
            self.sort_column, self.descending = "VRAM", True

    def header_label(self, label: str) -> str:
        if label != self.sort_column:
            return label
        return f"{label} {SORT_MARKS[0] if self.descending else SORT_MARKS[1]}"

    def show(self, rows: list[ProcGpu], snapshot: Any, system: HostSample | None) -> None:
        """Replace the rows, keeping the cursor on the same process when it is still there."""
        lookup = report.proc_host_lookup(system)
        keep = self.current_key()
        columns = text_report.process_columns(snapshot)
        self._set_columns(columns)
        ordered = sorted_rows(rows, self.sort_column, self.descending, lookup)
        self.clear()
        for key, col in zip(columns, self.columns.values(), strict=True):
            col.label = self.header_label(key)  # type: ignore[assignment]
        self.rows_shown = {}
        for p in ordered:
            k = row_key(p)
            if k in self.rows_shown:
                continue
            self.rows_shown[k] = p
            cells = text_report.process_cells(p, lookup, snapshot, columns)
            # Text, not str: names, command lines and model names come from outside and
            # must show as typed, never be read as Rich markup ("[mapped✓]", "[bold]")
            self.add_row(*(Text(c) for c in clip(cells, columns)), key=k)
        self._refresh_header()
        if keep is not None and keep in self.rows_shown:
            self.move_cursor(row=self.get_row_index(keep))

    def _refresh_header(self) -> None:
        self._require_update_dimensions = True
        self.refresh()

    def current_key(self) -> str | None:
        if not self.rows_shown or self.cursor_row < 0 or self.cursor_row >= self.row_count:
            return None
        try:
            return str(self.coordinate_to_cell_key((self.cursor_row, 0)).row_key.value)
        except Exception:  # no row under the cursor
            return None

    def current(self) -> ProcGpu | None:
        k = self.current_key()
        return None if k is None else self.rows_shown.get(k)

    def next_sort(self) -> None:
        sorts = [c for c in SORTS if c in self.columns_shown]
        i = sorts.index(self.sort_column) if self.sort_column in sorts else -1
        self.sort_column = sorts[(i + 1) % len(sorts)]
        self.descending = self.sort_column not in ("PID", "NAME")

    def reverse_sort(self) -> None:
        self.descending = not self.descending
