"""The Textual TUI: a header per GPU, a sortable process table, an inspector, the system
panel and a help screen.

Theory of operation
-------------------
`create_app()` builds the app for the CLI and for tests; tests pass a fake collector (any
object with ``sample_with_system()`` and ``close()``). A timer asks for a refresh every
`interval` seconds; the sample is taken in a thread worker (``@work(thread=True)``) so
NVML calls and /proc scans never stall the UI, and the result comes back as a small
`SampleReady` message. While one collection runs, further ticks are skipped rather than
queued (the collector is not thread-safe and a slow refresh must not pile up).

The UI never computes numbers of its own: every cell comes from `report`'s formatting of
readings, so the TUI, ``--once`` and ``--json`` always agree.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from textual import events, on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.message import Message
from textual.widgets import Footer, Input, Static

from gputaskman.base.readings import Adapter, ProcDetail, ProcGpu, Snapshot
from gputaskman.render import text_report
from gputaskman.render.report_owners import MEMORY_COLUMNS, OWNER_COLUMNS
from gputaskman.render.text_report import PROCESS_COLUMNS
from gputaskman.sampling.host import HostSample
from gputaskman.tui import settings as settings_mod
from gputaskman.tui import signalling
from gputaskman.tui.history import History
from gputaskman.tui.screens.help import HelpScreen
from gputaskman.tui.screens.signal import SignalScreen
from gputaskman.tui.settings import Settings
from gputaskman.tui.widgets.filter_box import FilterBox
from gputaskman.tui.widgets.gpu_header import GpuHeader
from gputaskman.tui.widgets.inspector import Inspector
from gputaskman.tui.widgets.process_table import ProcessTable
from gputaskman.tui.widgets.system_panel import SystemPanel
from gputaskman.tui.widgets.unchanged import update_static

# Below this many columns the process table needs the width: the inspector starts hidden.
INSPECTOR_MIN_COLS = 140
DEFAULT_INTERVAL = 1.0  # seconds between samples
# Below this many rows the header shows only each GPU's line, what is attributed and problems.
COMPACT_MAX_ROWS = 30


class CollectorLike(Protocol):
    """What the TUI needs of a collector (`sampling.collector.Collector` is the real one)."""

    def sample_with_system(self) -> tuple[Snapshot, HostSample | None]: ...

    def rescan(self, pid: int, create_time: float | None) -> ProcDetail | None:
        """One process scanned again now (enter); None when this collector cannot."""
        ...

    def close(self) -> None: ...


@dataclass
class SampleReady(Message):
    """A finished collection (posted from the worker thread)."""

    snapshot: Snapshot
    system: HostSample | None
    elapsed_s: float


@dataclass
class SampleFailed(Message):
    error: str


@dataclass
class RescanReady(Message):
    """An on-demand scan of one process finished (None: the collector cannot rescan)."""

    key: tuple[int, float | None]
    detail: ProcDetail | None


class GtmApp(App[int]):
    TITLE = "gputaskman"
    CSS = """
    #status { height: 1; padding: 0 1; background: $boost; }
    #main { height: 1fr; }
    """
    BINDINGS: ClassVar[list[Binding]] = [
        # The footer shows the first keys and "? all keys"; the rest are in the help screen.
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "all keys"),
        Binding("g", "next_gpu", "next GPU"),
        Binding("s", "next_sort", "sort by next column"),
        Binding("i", "toggle_inspector", "show/hide inspector"),
        Binding("G", "previous_gpu", "previous GPU", show=False),
        Binding("r", "reverse_sort", "reverse sort order", show=False),
        Binding("space", "toggle_pause", "pause/resume refresh", show=False),
        Binding("u", "refresh_now", "refresh now", show=False),
        Binding("enter", "rescan", "rescan the highlighted process now (inspector)", show=False),
        Binding(
            "slash",
            "filter",
            "filter rows (name, pid, command line, model, runtime); esc clears",
            show=False,
        ),
        Binding("escape", "clear_filter", "clear the filter", show=False),
        Binding("k", "signal", "signal the highlighted process (TERM, INT, KILL)", show=False),
        Binding("t", "toggle_tree", "tree: processes under their parent", show=False),
        Binding("m", "toggle_memory", "columns SWAPPED, LOCKED, PINNED on/off", show=False),
        Binding("o", "toggle_owner", "column OWNER (pod, job, unit) on/off", show=False),
    ]

    def __init__(
        self,
        collector_factory: Callable[[], CollectorLike],
        *,
        gpu: int | None = None,
        interval: float | None = None,
        readonly: bool = False,
        settings_path: Path | None = None,
    ) -> None:
        super().__init__()
        # settings_path None: nothing is read or saved (tests, replay of someone's file)
        self.settings_path = settings_path
        self.settings, self.settings_problem = (
            settings_mod.load(settings_path) if settings_path else (Settings(), None)
        )
        if interval is not None and interval != self.settings.interval and settings_path:
            self._save_settings(interval=interval)  # given on the command line: kept
        interval = interval or self.settings.interval or DEFAULT_INTERVAL
        self.readonly = readonly  # no key acts on a process (k is gone)
        self.filter_text = ""
        self._factory = collector_factory
        self._collector: CollectorLike | None = None
        self.interval = interval
        self.requested_gpu = gpu
        self.snapshot: Snapshot | None = None
        self.system: HostSample | None = None
        self.adapter_pos = 0
        self.paused = False
        self.samples = 0
        self.last_elapsed_s: float | None = None
        self.last_error: str | None = None
        self._busy = threading.Lock()
        self._inspector_wanted: bool | None = None  # None: by the terminal's width
        self.history = History()

    # -- layout

    def compose(self) -> ComposeResult:
        # Kept as attributes: app.query_one() searches the *active* screen, which is the
        # help screen while it is open, and a sample can arrive at any time.
        self.header = GpuHeader(id="gpu")
        self.table = ProcessTable(id="procs")
        self.inspector = Inspector(id="inspector")
        self.system_panel = SystemPanel(id="system")
        self.status = Static("", id="status")
        self.filter_box = FilterBox("filter: name, pid, command line, model, runtime", id="filter")
        yield self.header
        with Horizontal(id="main"):
            yield self.table
            yield self.inspector
        yield self.system_panel
        yield self.filter_box
        yield self.status
        yield Footer()

    def on_mount(self) -> None:
        st = self.settings
        self.table.sort_column, self.table.descending = st.sort, st.descending
        self.table.hidden = st.hidden_columns
        self.table.optional = st.shown_columns
        if st.theme is not None:
            if st.theme in self.available_themes:
                self.theme = st.theme
            else:
                self.settings_problem = f"settings: no theme {st.theme!r}; default used"
        if self.settings_problem:
            self.notify(self.settings_problem, severity="warning", timeout=10)
        self.theme_changed_signal.subscribe(self, self._theme_changed)
        self.header.show(None, None)
        self.system_panel.show(None)
        self.table.focus()
        self._fit_inspector(self.size.width)
        self.set_interval(self.interval, self.request_refresh)
        self.request_refresh()

    def on_resize(self, event: events.Resize) -> None:
        self._fit_inspector(event.size.width)
        if self.snapshot is not None:
            self.render_all()  # the table's columns fit the new width

    def _fit_inspector(self, width: int) -> None:
        """Until the user toggles it (i), the inspector shows only where the table keeps room
        for its columns beside it (INSPECTOR_MIN_COLS). It takes about a quarter of a wide
        screen, so that long paths wrap less."""
        self.inspector.styles.width = max(46, min(72, width // 4))
        if self._inspector_wanted is None:
            self.inspector.set_class(width < INSPECTOR_MIN_COLS, "-hidden")

    def on_unmount(self) -> None:
        if self._collector is not None:
            self._collector.close()

    # -- collection (off the UI thread)

    def request_refresh(self) -> None:
        if self.paused:
            return
        if not self._busy.acquire(blocking=False):
            return  # the previous collection is still running: skip this tick
        self.collect()

    @work(thread=True, group="collect")
    def collect(self) -> None:
        try:
            if self._collector is None:
                self._collector = self._factory()
            t0 = time.perf_counter()
            snap, system = self._collector.sample_with_system()
            self.post_message(SampleReady(snap, system, time.perf_counter() - t0))
        except Exception as exc:  # a broken probe must not take the UI down
            self.post_message(SampleFailed(f"{type(exc).__name__}: {exc}"))
        finally:
            self._busy.release()

    def on_sample_ready(self, msg: SampleReady) -> None:
        first = self.snapshot is None
        self.snapshot, self.system = msg.snapshot, msg.system
        self.history.add(msg.snapshot)
        self.samples += 1
        self.last_elapsed_s = msg.elapsed_s
        self.last_error = None
        if first and self.requested_gpu is not None:
            pos = next(
                (i for i, a in enumerate(self.snapshot.adapters) if a.index == self.requested_gpu),
                None,
            )
            if pos is None:
                self.notify(f"GPU {self.requested_gpu} is not listed", severity="warning")
            else:
                self.adapter_pos = pos
        self.render_all()

    def on_sample_failed(self, msg: SampleFailed) -> None:
        self.last_error = msg.error
        self.render_status()

    # -- rendering

    @property
    def adapter(self) -> Adapter | None:
        if self.snapshot is None or not self.snapshot.adapters:
            return None
        return self.snapshot.adapters[self.adapter_pos % len(self.snapshot.adapters)]

    def visible_rows(self) -> list[ProcGpu]:
        if self.snapshot is None:
            return []
        a = self.adapter
        rows = list(self.snapshot.processes)
        if a is not None:
            rows = [p for p in rows if p.adapter in (a.pci_bus_id, None)]
        if self.filter_text:
            rows = [p for p in rows if matches(p, self.filter_text)]
        return rows

    def render_all(self) -> None:
        compact = self.size.height < COMPACT_MAX_ROWS
        self.header.show(self.snapshot, self.adapter, self.history, compact)
        table = self.table
        table.show(self.visible_rows(), self.snapshot, self.system, self.table_width())
        self.system_panel.show(self.system, compact)
        self.render_inspector()
        self.render_status()

    def table_width(self) -> int:
        """The process table's room: the screen's width less the inspector's, when shown."""
        width = self.size.width
        if not self.inspector.has_class("-hidden"):
            width -= self.inspector.styles.width.cells or 0  # type: ignore[union-attr]
        return width

    def render_inspector(self) -> None:
        table = self.table
        self.inspector.show(table.current(), self.snapshot, self.system, self.history)

    def render_status(self) -> None:
        parts = []
        if self.snapshot is not None:
            try:
                when = time.strftime("%H:%M:%S", time.localtime(self.snapshot.taken))
            except (ValueError, OverflowError, OSError):  # a replayed file may hold any time
                when = "n/a"
            took = "" if self.last_elapsed_s is None else f" in {self.last_elapsed_s * 1000:.0f} ms"
            parts.append(f"sample {when}{took}")
        table = self.table
        n = len(table.rows_shown)
        if self.filter_text:
            parts.append(f"filter {self.filter_text!r}: {n} shown")
        else:
            parts.append(f"{n} process{'' if n == 1 else 'es'}")
        parts.append(
            f"sort {table.header_label(table.sort_column)}" + (" · tree" if table.as_tree else "")
        )
        parts.append("PAUSED" if self.paused else f"every {self.interval:g}s")
        if self.last_error:
            parts.append(f"refresh failed: {self.last_error}")
        parts.append("? help")
        update_static(self.status, " · ".join(parts))

    # -- on-demand rescan of one process (inspector)

    def action_rescan(self) -> None:
        p = self.table.current()
        if p is None:
            return
        if not self._busy.acquire(blocking=False):
            self.notify("a refresh is running; try again")
            return
        self.rescan(p.pid, p.create_time)

    @work(thread=True, group="collect")
    def rescan(self, pid: int, create_time: float | None) -> None:
        try:
            collector = self._collector  # None in replay: nothing live to scan
            detail = collector.rescan(pid, create_time) if collector is not None else None
            self.post_message(RescanReady((pid, create_time), detail))
        except Exception as exc:  # a process that vanished or a denied read: say so
            self.post_message(SampleFailed(f"rescan of {pid}: {type(exc).__name__}: {exc}"))
        finally:
            self._busy.release()

    def on_rescan_ready(self, msg: RescanReady) -> None:
        if msg.detail is None:
            self.notify("this collector cannot rescan one process")
            return
        for k, p in list(self.table.rows_shown.items()):
            if p.key == msg.key:
                self.table.update_row(k, dataclasses.replace(p, detail=msg.detail))
        self.render_inspector()
        self.notify(f"rescanned {msg.key[0]}")

    # -- events and actions

    @on(ProcessTable.RowSelected)
    def _row_selected(self, _event: ProcessTable.RowSelected) -> None:
        self.action_rescan()  # the table takes enter itself and reports it as a selection

    @on(ProcessTable.RowHighlighted)
    def _row_highlighted(self, _event: ProcessTable.RowHighlighted) -> None:
        self.render_inspector()

    def action_help(self) -> None:
        keys = [b for b in self.BINDINGS if self.check_action(b.action, ()) is not False]
        self.push_screen(HelpScreen(keys))  # type: ignore[arg-type]

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # --readonly (and replay): the signal key does not exist
        return not (action == "signal" and self.readonly)

    # -- filter

    def action_filter(self) -> None:
        self.filter_box.open()

    def action_clear_filter(self) -> None:
        self.filter_box.clear()  # the rows come back through _filter_changed
        self.table.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        if self.snapshot is not None:
            self.render_all()

    @on(Input.Submitted, "#filter")
    def _filter_kept(self, _event: Input.Submitted) -> None:
        self.filter_box.close()
        self.table.focus()

    # -- signal

    def action_signal(self) -> None:
        row = self.table.current()
        if row is None:
            self.notify("no process selected")
            return

        def chosen(name: str | None) -> None:
            if name is None:
                return
            result = signalling.send(row, name)
            self.notify(result.message, severity="information" if result.sent else "error")
            if result.sent:
                self.action_refresh_now()

        self.push_screen(SignalScreen(row), chosen)

    def _move_gpu(self, step: int) -> None:
        if self.snapshot is None or len(self.snapshot.adapters) < 2:
            self.notify("only one GPU" if self.adapter else "no GPU to switch to")
            return
        self.adapter_pos = (self.adapter_pos + step) % len(self.snapshot.adapters)
        self.render_all()

    def action_next_gpu(self) -> None:
        self._move_gpu(1)

    def action_previous_gpu(self) -> None:
        self._move_gpu(-1)

    def action_next_sort(self) -> None:
        snap = self.snapshot
        self.table.next_sort(text_report.process_columns(snap) if snap else PROCESS_COLUMNS)
        self._save_settings(sort=self.table.sort_column, descending=self.table.descending)
        self.render_all()

    def action_reverse_sort(self) -> None:
        self.table.reverse_sort()
        self._save_settings(descending=self.table.descending)
        self.render_all()

    # -- settings

    def _theme_changed(self, theme: object) -> None:
        self._save_settings(theme=self.theme)

    def _save_settings(self, **changes: object) -> None:
        self.settings = dataclasses.replace(self.settings, **changes)  # type: ignore[arg-type]
        if self.settings_path is None:
            return
        problem = settings_mod.save(self.settings, self.settings_path)
        if problem and problem != self.settings_problem:  # said once, not at every key
            self.settings_problem = problem
            self.notify(problem, severity="warning")

    def action_toggle_inspector(self) -> None:
        self._inspector_wanted = self.inspector.has_class("-hidden")
        self.inspector.set_class(not self._inspector_wanted, "-hidden")
        if self.snapshot is not None:
            self.render_all()  # the table's room changed

    def action_toggle_tree(self) -> None:
        self.table.as_tree = not self.table.as_tree
        if self.snapshot is not None:
            self.render_all()

    def action_toggle_memory(self) -> None:
        self._toggle_columns(MEMORY_COLUMNS)

    def action_toggle_owner(self) -> None:
        self._toggle_columns(OWNER_COLUMNS)

    def _toggle_columns(self, columns: tuple[str, ...]) -> None:
        """Turn `columns` on (when any is off) or off, and keep the choice in the settings."""
        on = self.table.optional
        on = tuple(c for c in on if c not in columns) if set(columns) <= set(on) else on + columns
        self.table.optional = tuple(dict.fromkeys(on))
        self._save_settings(shown_columns=self.table.optional)
        if self.snapshot is not None:
            self.render_all()

    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.render_status()

    def action_refresh_now(self) -> None:
        was, self.paused = self.paused, False
        self.request_refresh()
        self.paused = was


def matches(p: ProcGpu, text: str) -> bool:
    """Whether row `p` matches a filter: `text` (any case) in its PID, name, command line
    (as shown: secrets redacted), model, runtimes or category."""
    needle = text.casefold()
    hay = [str(p.pid), p.name or "", p.detail.category or "", *p.detail.runtimes]
    if p.detail.cmdline:
        hay.append(" ".join(p.detail.cmdline))
    if p.model is not None:
        hay.append(p.model.name)
    return any(needle in h.casefold() for h in hay)


def create_app(
    gpu: int | None = None,
    interval: float | None = 1.0,
    collector_factory: Callable[[], CollectorLike] | None = None,
    readonly: bool = False,
    settings_path: Path | None = None,
) -> GtmApp:
    """The app for the CLI (real `Collector`) and for tests (a fake collector factory)."""
    if collector_factory is None:

        def collector_factory() -> CollectorLike:
            from gputaskman.sampling.collector import Collector

            return Collector(gpu=gpu)

    return GtmApp(
        collector_factory,
        gpu=gpu,
        interval=interval,
        readonly=readonly,
        settings_path=settings_path,
    )
