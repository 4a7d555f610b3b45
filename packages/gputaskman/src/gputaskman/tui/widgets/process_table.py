"""The sortable process table.

Rows are `ProcGpu` entries of the selected adapter plus runtime candidates with no GPU
context. VRAM cells show `shown_vram` with its provenance marker (display and sorting
only); unknown is n/a, sorted after every known value whichever the direction. Rows are
keyed by ``pid@adapter`` so the cursor stays on the same process across refreshes.

A PAGED column (Windows non-local / macOS compressed graphics memory) appears after VRAM
only while some row has a paged reading (`text_report.process_columns`). SWAPPED, LOCKED
and PINNED (``/proc/PID/status``; SWAPPED says ``pool`` when duvm's device is the only swap)
and OWNER (pod, Slurm job, container, session or unit from the cgroup) are off until the
user turns them on (keys m and o, kept in the settings' ``shown_columns``).

The table fits its width: columns are kept in the order of `PRIORITY` while they fit (PID,
NAME, VRAM and MODEL always, and the sort column, arrow included), and when even those do not
fit, the model's and then the process's name are cut (never the model's evidence marker). The
columns are rebuilt only when that choice changes, never on an ordinary refresh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.cells import cell_len
from textual import events

from gputaskman.base.fmt import NA, fmt_reading
from gputaskman.base.readings import ProcGpu, Reading
from gputaskman.render import report, text_report
from gputaskman.render.report_owners import OPTIONAL_COLUMNS, memory_cells, owner_cell
from gputaskman.sampling.host import HostSample
from gputaskman.tui.widgets.line_table import LineTable

# column label, sort name (None: not a sort column)
COLUMNS = text_report.PROCESS_COLUMNS
SORTS = ("VRAM", "PAGED", "GPU%", "RAM", "CPU%", "PID", "NAME")
# Per-process engine load (NVML's process utilisation), each a column only while some row has
# a known value for it: label -> key in `ProcGpu.engines`.
ENGINE_COLUMNS = {"GPU%": "gpu_percent", "ENC%": "encoder_percent", "DEC%": "decoder_percent"}
# Shown after the sort column's label: (descending, ascending).
SORT_MARKS = ("▼", "▲")


# Columns of the process's identity from procinfo's scan, after the others, shown where the
# width allows: its user, how long it has run, and its command line (secrets redacted).
IDENTITY_COLUMNS = ("USER", "TIME", "COMMAND")
# Widest a text cell may be in the table; the inspector shows the full value.
CELL_LIMITS = {
    "RUNTIMES": 22,
    "MODEL": 24,
    "NAME": 18,
    "CATEGORY": 16,
    "USER": 10,
    "COMMAND": 48,
    "OWNER": 24,
}
# Which columns a narrow table keeps, first first; the first four are always kept.
PRIORITY = (
    "PID",
    "NAME",
    "VRAM",
    "MODEL",
    "GPU%",
    "RAM",
    "CPU%",
    "SWAPPED",
    "LOCKED",
    "PINNED",
    "OWNER",
    "GPU",
    "PAGED",
    "ENC%",
    "DEC%",
    "CATEGORY",
    "USER",
    "TIME",
    "RUNTIMES",
    "COMMAND",
)
ALWAYS = PRIORITY[:4]
# The widest MODEL may get when the table has room for it (its names are long).
MODEL_ROOM = 40
# The narrowest the cut cells may get before the table scrolls sideways instead.
MIN_LIMITS = {"MODEL": 14, "NAME": 8}
CELL_PAD = 2  # a cell's padding, one column each side
SCROLLBAR = 2  # room kept for the vertical scrollbar


def clip(
    cells: tuple[str, ...],
    columns: tuple[str, ...] = COLUMNS,
    limits: Mapping[str, int] = CELL_LIMITS,
) -> tuple[str, ...]:
    out = []
    for label, cell in zip(columns, cells, strict=True):
        limit = limits.get(label)
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


def fit_columns(
    columns: tuple[str, ...],
    rows: list[tuple[str, ...]],
    width: int,
    sort_label: tuple[str, str],
) -> tuple[tuple[str, ...], dict[str, int]]:
    """The columns of `columns` to show in `width` cells, and the cell limits to clip with.

    `rows` are the unclipped cells of every row, in `columns` order; `sort_label` is the sort
    column and its header label (with the arrow), whose width counts too."""
    limits = dict(CELL_LIMITS, MODEL=MODEL_ROOM)
    # Each column's widest cell once; a clipped cell is at most its limit wide (`clip`).
    widest = {c: max((len(r[i]) for r in rows), default=0) for i, c in enumerate(columns)}

    def need(col: str) -> int:
        label = sort_label[1] if col == sort_label[0] else col
        cell = widest[col]
        if col in limits:
            cell = min(cell, limits[col])
        return max(len(label), cell) + CELL_PAD

    room = width - SCROLLBAR
    keep = [c for c in ALWAYS if c in columns]
    if sort_label[0] in columns and sort_label[0] not in keep:  # (unless hidden)
        keep.append(sort_label[0])
    used = sum(need(c) for c in keep)
    for col in (c for c in PRIORITY if c in columns and c not in keep):
        w = need(col)
        if used + w <= room:
            keep.append(col)
            used += w
    if "MODEL" in keep and used < room:  # room to spare: the model's name shows in full
        limits["MODEL"] = min(MODEL_ROOM, need("MODEL") - CELL_PAD + room - used)
    for col in ("MODEL", "NAME"):  # still too wide: cut the names, the model's first
        if used <= room or col not in keep:
            continue
        before = need(col)
        limits[col] = max(MIN_LIMITS[col], before - CELL_PAD - (used - room))
        used += need(col) - before
    return tuple(c for c in columns if c in keep), limits


def elapsed(seconds: float | None) -> str:
    """How long a process has run, as ps prints it: ``M:SS``, ``H:MM:SS``, ``D-HH:MM:SS``."""
    if seconds is None or seconds < 0:
        return NA
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{s:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{s:02d}"
    return f"{minutes}:{s:02d}"


def identity_cells(p: ProcGpu, taken: float) -> tuple[str, str, str]:
    """USER, TIME and COMMAND of row `p` in a snapshot taken at `taken` (n/a: unknown)."""
    d = p.detail
    ran = None if p.create_time is None or p.host is not None else taken - p.create_time
    command = NA if d.cmdline is None else " ".join(d.cmdline) or NA
    return (d.user or NA, elapsed(ran), command)


def tree_order(rows: list[ProcGpu]) -> tuple[list[ProcGpu], dict[str, str]]:
    """`rows` (already sorted) with each process right after its parent, when its parent is
    a row too, and the branch drawn before each child's name (by row key)."""
    first = {}
    for p in rows:
        first.setdefault(p.pid, p)
    children: dict[int, list[ProcGpu]] = {}
    roots = []
    for p in rows:
        parent = p.detail.ppid
        if parent is not None and parent in first and parent != p.pid and p is first[p.pid]:
            children.setdefault(parent, []).append(p)
        else:
            roots.append(p)
    out: list[ProcGpu] = []
    marks: dict[str, str] = {}
    seen: set[int] = set()

    def walk(p: ProcGpu, indent: str, branch: str) -> None:
        out.append(p)
        marks[row_key(p)] = indent + branch
        if p is not first[p.pid] or p.pid in seen:
            return
        seen.add(p.pid)
        kids = children.get(p.pid, [])
        below = indent + ("│ " if branch == "├ " else "  " if branch else "")
        for i, k in enumerate(kids):
            walk(k, below, "└ " if i == len(kids) - 1 else "├ ")

    for r in roots:
        walk(r, "", "")
    for p in rows:  # a cycle in the parent links: kept, flat
        if row_key(p) not in marks:
            out.append(p)
            marks[row_key(p)] = ""
    return out, marks


def engine_columns(rows: list[ProcGpu]) -> tuple[str, ...]:
    """The engine columns some row has a known value for (unknown everywhere: no column)."""
    return tuple(
        label
        for label, key in ENGINE_COLUMNS.items()
        if any((r := p.engines.get(key)) is not None and r.value is not None for p in rows)
    )


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
    elif column in ENGINE_COLUMNS:
        v = _num(p.engines.get(ENGINE_COLUMNS[column]))
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
    if column in ("RAM", "CPU%"):  # only these read the host's side of a process
        keyed = [(sort_value(p, column, lookup(p.pid, p.create_time) or {}), p) for p in rows]
    else:
        keyed = [(sort_value(p, column, {}), p) for p in rows]
    known = [x for x in keyed if x[0][0] == 0]
    unknown = [x for x in keyed if x[0][0] == 1]
    known.sort(key=lambda x: (x[0][1], x[1].pid), reverse=descending)
    unknown.sort(key=lambda x: x[1].pid)
    return [p for _, p in known + unknown]


class ProcessTable(LineTable):
    """The process rows of one refresh: sorted (and treed) in full, formatted only where
    drawn. The columns and their widths fit the rows on screen, and are fitted again when the
    view scrolls."""

    DEFAULT_CSS = """
    ProcessTable { height: 1fr; }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sort_column = "VRAM"
        self.descending = True
        self.rows_shown: dict[str, ProcGpu] = {}
        self.columns_shown: tuple[str, ...] = COLUMNS
        self.hidden: tuple[str, ...] = ()  # columns the user's settings leave out
        self.optional: tuple[str, ...] = ()  # of OPTIONAL_COLUMNS, those turned on (m, o)
        self.as_tree = False  # rows under their parent process (t)
        self._every: tuple[str, ...] = COLUMNS  # every column this refresh could show
        self._row_cells: Callable[[ProcGpu], tuple[str, ...]] = lambda _p: ()
        self._full: dict[str, tuple[str, ...]] = {}  # rows formatted this refresh, unclipped
        self._shown: dict[str, tuple[str, ...]] = {}  # rows formatted and clipped to the columns
        self._room = 0  # the width the columns are fitted to
        self._limits: Mapping[str, int] = CELL_LIMITS
        self._picks: list[int] = []  # where each shown column is in `_every`

    def header_label(self, label: str) -> str:
        if label != self.sort_column:
            return label
        return f"{label} {SORT_MARKS[0] if self.descending else SORT_MARKS[1]}"

    def show(
        self, rows: list[ProcGpu], snapshot: Any, system: HostSample | None, width: int
    ) -> None:
        """Replace the rows, keeping the cursor on the same process when it is still there;
        `width` is the table's room in cells (the columns are fitted to it)."""
        lookup = report.proc_host_lookup(system)
        keep = self.current_key()
        engines = engine_columns(rows)
        base = text_report.process_columns(snapshot)
        at = base.index("PAGED" if "PAGED" in base else "VRAM") + 1
        # loads after memory; the columns a user turns on (m, o) last, fitted by PRIORITY
        every = (*base[:at], *engines, *base[at:], *IDENTITY_COLUMNS, *OPTIONAL_COLUMNS)
        if self.sort_column not in every:  # the PAGED or an engine column went away
            self.sort_column, self.descending = "VRAM", True
        ordered = sorted_rows(rows, self.sort_column, self.descending, lookup)
        branches: dict[str, str] = {}
        if self.as_tree:
            ordered, branches = tree_order(ordered)
        name_at = every.index("NAME")
        taken = snapshot.taken if snapshot is not None else 0.0

        def row_cells(p: ProcGpu) -> tuple[str, ...]:
            cells = text_report.process_cells(p, lookup, snapshot, base)
            loads = tuple(fmt_reading(p.engines.get(ENGINE_COLUMNS[c]), "%") for c in engines)
            row = [*cells[:at], *loads, *cells[at:], *identity_cells(p, taken)]
            row += [*memory_cells(p), owner_cell(p.owner)]
            branch = branches.get(row_key(p))
            if branch:
                row[name_at] = branch + row[name_at]
            return tuple(row)

        shown: dict[str, ProcGpu] = {}
        for p in ordered:
            shown.setdefault(row_key(p), p)
        self.rows_shown = shown
        self._every, self._row_cells, self._room = every, row_cells, width
        self._full = {}
        self.set_rows(list(shown), keep)
        self._fit()

    def _cells(self, key: str) -> tuple[str, ...]:
        """Row `key`'s cells in every column this refresh offers, formatted once."""
        cells = self._full.get(key)
        if cells is None:
            cells = self._full[key] = self._row_cells(self.rows_shown[key])
        return cells

    def _fit(self) -> None:
        """Choose the columns and their widths for the rows on screen."""
        every = self._every
        window = [self.keys[i] for i in self.visible_range()]
        sort = (self.sort_column, self.header_label(self.sort_column))
        offered = tuple(
            c
            for c in every
            if c not in self.hidden and (c not in OPTIONAL_COLUMNS or c in self.optional)
        )
        picks = [every.index(c) for c in offered]
        cells = [tuple(self._cells(k)[i] for i in picks) for k in window]
        columns, limits = fit_columns(offered, cells, self._room, sort)
        self.columns_shown, self._limits = columns, limits
        self._picks = [every.index(c) for c in columns]
        self._shown = {}
        labels = tuple(self.header_label(c) for c in columns)
        widths = [cell_len(label) for label in labels]
        for k in window:
            for i, cell in enumerate(self.get_row(k)):
                widths[i] = max(widths[i], cell_len(cell))
        self.set_columns(labels, widths, self.get_row)

    def get_row(self, key: str) -> tuple[str, ...]:
        """Row `key` as drawn: its cells in the columns shown, clipped to their limits."""
        cells = self._shown.get(key)
        if cells is None:
            full = self._cells(key)
            picked = tuple(full[i] for i in self._picks)
            cells = self._shown[key] = clip(picked, self.columns_shown, self._limits)
        return cells

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if round(old_value) != round(new_value) and self.rows_shown:
            self.call_later(self._fit)  # other rows on screen: fit the columns to them

    def on_resize(self, _event: events.Resize) -> None:
        if self.rows_shown:
            self._fit()  # more or fewer rows on screen

    def update_row(self, key: str, p: ProcGpu) -> None:
        """Row `key` holds `p` now (a rescan's detail): formatted again when drawn."""
        self.rows_shown[key] = p
        self._full.pop(key, None)
        self._shown.pop(key, None)
        self.redraw()

    def current(self) -> ProcGpu | None:
        k = self.current_key()
        return None if k is None else self.rows_shown.get(k)

    def next_sort(self, columns: tuple[str, ...]) -> None:
        """Sort by the next of `columns` (the snapshot's, shown or not) that sorts."""
        sorts = [c for c in SORTS if c in columns]
        i = sorts.index(self.sort_column) if self.sort_column in sorts else -1
        self.sort_column = sorts[(i + 1) % len(sorts)]
        self.descending = self.sort_column not in ("PID", "NAME")

    def reverse_sort(self) -> None:
        self.descending = not self.descending
