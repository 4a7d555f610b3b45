"""The fleet screen: the summary line, the fleet table, a filter and a status line.

`show(states)` redraws from the poller's states (`fleet.view` makes the rows and totals, the
table fits them); what opening a host and polling now do is the app's (`drill`,
`poll_now`). Keys, as in the single-host TUI: ``s`` sorts by the next column (HOST, MEMORY
used, MEMORY %, UTIL), ``r`` reverses (unknown values stay last either way), ``/`` filters
the rows live (host, status, GPU, models, and the name and command line of every process on
the GPU, not only of those shown) and ``esc`` clears the filter, ``u``
polls every host now, ``enter`` opens the highlighted host's full view, ``?`` lists keys,
columns and statuses, ``q`` quits.

The status line names the highlighted row's host with its status in full (a cell may be
cut), how the fleet is polled, and what is sorted and filtered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from gputaskman.fleet.poller import HostState
from gputaskman.fleet.view import (
    SORT_COLUMNS,
    FleetRow,
    ViewCache,
    fleet_rows,
    fleet_totals,
    host_line,
    matches,
    summary_line,
)
from gputaskman.tui.widgets.filter_box import FilterBox
from gputaskman.tui.widgets.fleet_table import FleetTable


class FleetScreen(Screen[None]):
    CSS = """
    #fleet-summary { height: auto; max-height: 3; padding: 0 1; background: $boost; }
    #fleet-status { height: 1; padding: 0 1; background: $boost; }
    """
    BINDINGS: ClassVar[list[Binding]] = [
        Binding("q", "app.quit", "quit"),
        Binding("question_mark", "app.fleet_help", "all keys"),
        Binding("enter", "drill", "host view"),
        Binding("s", "next_sort", "sort by next column"),
        Binding("r", "reverse_sort", "reverse sort order", show=False),
        Binding(
            "slash",
            "filter",
            "filter rows (host, status, GPU, process and its command line, model)",
            show=False,
        ),
        Binding("escape", "clear_filter", "clear the filter", show=False),
        Binding("u", "poll_now", "poll every host now", show=False),
    ]

    def __init__(
        self,
        describe_polling: str,
        drill: Callable[[str], None],
        poll_now: Callable[[], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.describe_polling = describe_polling  # "every 1 s, timeout 2 s" for the status
        self.drill = drill  # open a host's full view, by name
        self.poll_now = poll_now
        self.states: tuple[HostState, ...] = ()
        self._rows = ViewCache()  # each host's rows, rebuilt only when its state changes
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        self.summary = Static("", id="fleet-summary")
        self.table = FleetTable(id="fleet-table")
        self.filter_box = FilterBox(
            "filter: host, status, GPU, process, command line, model", id="fleet-filter"
        )
        self.status = Static("", id="fleet-status")
        yield self.summary
        yield self.table
        yield self.filter_box
        yield self.status
        yield Footer()

    def on_mount(self) -> None:
        self.table.focus()
        self.show(self.states)

    def on_resize(self) -> None:
        self.show(self.states)

    def show(self, states: Sequence[HostState]) -> None:
        self.states = tuple(states)
        if not self.is_mounted:
            return
        rows = fleet_rows(self.states, cache=self._rows)
        if self.filter_text:
            rows = [r for r in rows if matches(r, self.filter_text)]
        self.summary.update(Text(summary_line(fleet_totals(self.states, self._rows))))
        self.table.show(rows, self.size.width)
        self.render_status()

    def render_status(self) -> None:
        t = self.table
        parts = []
        row = t.current()
        if row is not None:
            state = row.state
            parts.append(f"{row.host}: " + ("up" if state.up else host_line(state)))
        n = len(t.rows_shown)
        if self.filter_text:
            parts.append(f"filter {self.filter_text!r}: {n} rows shown")
        parts.append(f"sort {t.header_label(_shown_on(t.sort_column))}")
        parts.append(f"polling {self.describe_polling}")
        parts.append("enter host view · ? help")
        self.status.update(Text(" · ".join(parts)))

    def current(self) -> FleetRow | None:
        return self.table.current()

    # -- keys

    def action_drill(self) -> None:
        row = self.table.current()
        if row is not None:
            self.drill(row.host)

    @on(FleetTable.RowSelected, "#fleet-table")
    def _selected(self, event: FleetTable.RowSelected) -> None:
        event.stop()  # the live app's own handler (rescan) is not for this table
        self.action_drill()

    @on(FleetTable.RowHighlighted, "#fleet-table")
    def _highlighted(self, event: FleetTable.RowHighlighted) -> None:
        event.stop()
        self.render_status()

    def action_next_sort(self) -> None:
        t = self.table
        i = SORT_COLUMNS.index(t.sort_column)
        t.sort_column = SORT_COLUMNS[(i + 1) % len(SORT_COLUMNS)]
        t.descending = t.sort_column != "HOST"
        self.show(self.states)

    def action_reverse_sort(self) -> None:
        self.table.descending = not self.table.descending
        self.show(self.states)

    def action_poll_now(self) -> None:
        self.poll_now()

    def action_filter(self) -> None:
        self.filter_box.open()

    def action_clear_filter(self) -> None:
        self.filter_box.clear()  # the rows come back through _filter_changed
        self.table.focus()

    @on(Input.Changed, "#fleet-filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.filter_text = event.value.strip()
        self.show(self.states)

    @on(Input.Submitted, "#fleet-filter")
    def _filter_kept(self, event: Input.Submitted) -> None:
        event.stop()
        self.filter_box.close()
        self.table.focus()


def _shown_on(sort: str) -> str:
    return "MEMORY" if sort in ("MEMORY", "MEM%") else sort
