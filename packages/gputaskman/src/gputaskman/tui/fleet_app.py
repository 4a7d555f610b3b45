"""The fleet TUI: every host's GPUs in one table, and any host's full live view one key away.

Theory of operation
-------------------
`FleetApp` subclasses `app.GtmApp`, so a host's view is the live app's own screen: header
with sparklines, process table, inspector, system panel, sorting, filtering and GPU
switching, all its code. The fleet table is a `screens.fleet.FleetScreen` pushed over it at
start, installed (a popped screen that is not installed is removed, and Textual never draws
one pushed back after that). ``enter`` on a host pops the fleet screen and shows that host;
``esc`` (once any filter is cleared) pushes the fleet screen back.

The seam is `GtmApp.request_refresh`, which the live app's timer calls every poll interval
(as `replay_app` uses it): here nothing is sampled. It redraws the fleet screen when
the poller has published since the last tick, and, while a host is open, hands that host's
newest document to the live app's `on_sample_ready` as replay's objects
(`recorded.replay_objects`), once per document (`HostState.seq`), so the sparklines grow one
point per answer. The source (`fleet.source.FleetSource`: the direct poller, or Prometheus,
which also polls the open host directly through `focus`) runs on its own thread, started
and stopped by the caller; the collector factory given to the base class raises, so the
fleet view never samples this machine. A source that fails as a whole (Prometheus down) is
notified once per new failure.

A host that goes down while open keeps its last document on screen, and the status line says
so: the host, its status and reason, and when that document arrived. The app is read-only
(``k`` does not exist: remote processes are not this machine's to signal), ``enter`` on
a process does not rescan it (the host's own serve scans; the host view's help leaves it
out), and ``u`` there polls now, as on the fleet table.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.binding import Binding

from gputaskman.document.reader import SnapshotError
from gputaskman.fleet.poller import HostState
from gputaskman.fleet.source import FleetSource
from gputaskman.offline.recorded import replay_objects
from gputaskman.tui.app import GtmApp, SampleReady
from gputaskman.tui.screens.fleet import FleetScreen
from gputaskman.tui.screens.fleet_help import FleetHelpScreen
from gputaskman.tui.screens.help import HelpScreen

BACK = "clear the filter, else back to the fleet"
# the host view's keys that do something else here, in the words its help gives them
HOST_KEYS = {"clear_filter": BACK, "refresh_now": "poll every host now"}
# the live app's actions that stay meaningful over the fleet table
FLEET_ACTIONS = {"quit", "fleet_help", "help"}
FLEET_SCREEN = "fleet"  # the fleet screen's name as installed


def _no_collector() -> object:
    raise RuntimeError("the fleet view never samples this machine")


class FleetApp(GtmApp):
    TITLE = "gputaskman fleet"

    def __init__(self, source: FleetSource) -> None:
        # redrawn as often as the hosts are polled ("every N s" in the host view is right)
        super().__init__(_no_collector, interval=source.interval, readonly=True)  # type: ignore[arg-type]
        self.source = source
        origin = f"{source.origin}, " if source.origin else ""
        self.fleet = FleetScreen(
            f"{origin}every {source.interval:g} s, timeout {source.timeout:g} s",
            self.drill,
            source.poll_now,
        )
        self.host_name: str | None = None
        self._shown: tuple[str, int, bool] | None = None  # (host, seq, from_series) shown
        self._version: int | None = None
        self._error: str | None = None  # the source's last failure, notified once

    def on_mount(self) -> None:
        super().on_mount()
        # installed, so that popping it (enter on a host) keeps it alive: Textual removes a
        # popped screen that is not installed, and one pushed back after that is never drawn
        # again (its update timer died with it)
        self.install_screen(self.fleet, FLEET_SCREEN)
        self.push_screen(FLEET_SCREEN)

    # -- the seam: the live app's timer lands here

    def request_refresh(self) -> None:
        if self.paused:
            return
        version = self.source.version
        if version != self._version:
            self._version = version
            self.fleet.show(self.source.states())
            error = self.source.error
            if error is not None and error != self._error:
                self.notify(error, title="the fleet's source", severity="error")
            self._error = error
        if self.host_name is not None:
            self._show_host()

    def host_state(self) -> HostState | None:
        return next((s for s in self.source.states() if s.target.name == self.host_name), None)

    def _show_host(self) -> None:
        s = self.host_state()
        if s is None or s.document is None or not s.whole:  # the table's part is no view
            self.render_status()
            return
        key = (s.target.name, s.seq, s.from_series)
        if key == self._shown:
            self.render_status()
            return
        self._shown = key
        try:
            snapshot, system = replay_objects(s.document)
        except SnapshotError as exc:  # read, but not showable (a GPU without an address)
            self.last_error = f"{s.target.name}'s document cannot be shown: {exc}"
            self.render_status()
            return
        self.on_sample_ready(SampleReady(snapshot, system, s.latency_s or 0.0))

    # -- between the fleet and a host

    def drill(self, name: str) -> None:
        """Open host `name`'s full view (a host that never answered has none: say why)."""
        s = next((x for x in self.source.states() if x.target.name == name), None)
        if s is None or s.document is None:
            why = "" if s is None else f": {s.status}" + (f" ({s.reason})" if s.reason else "")
            self.notify(f"{name} has not answered yet{why}", severity="warning")
            return
        self.host_name = name
        self.source.focus(name)
        self._shown = None
        self.snapshot = None
        self.adapter_pos = 0
        self.history.clear()  # another host's past is not this one's
        self.sub_title = name
        if self.screen is self.fleet:
            self.pop_screen()
        self._show_host()

    def action_fleet(self) -> None:
        self.host_name = None
        self.source.focus(None)
        self.sub_title = ""
        if self.screen is not self.fleet:
            self.push_screen(FLEET_SCREEN)

    def action_clear_filter(self) -> None:
        """esc on a host: clear its filter first, then back to the fleet."""
        if self.filter_text or not self.filter_box.has_class("-hidden"):
            super().action_clear_filter()
        else:
            self.action_fleet()

    def action_rescan(self) -> None:
        self.notify("a fleet host's processes are scanned by its own serve")

    def action_refresh_now(self) -> None:
        """u on a host: poll now (every host, as the fleet's u), and show what is newest."""
        self.source.poll_now()
        super().action_refresh_now()

    def action_help(self) -> None:
        """The host view's keys, esc saying where it goes."""
        keys = [
            Binding(b.key, b.action, HOST_KEYS[b.action]) if b.action in HOST_KEYS else b
            for b in GtmApp.BINDINGS
            if self.check_action(b.action, ()) is not False
        ]
        self.push_screen(HelpScreen(keys))

    def action_fleet_help(self) -> None:
        self.push_screen(FleetHelpScreen([*self.fleet.BINDINGS]))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # over the fleet table only its own keys and quit/help act; the host view's do not
        if self.screen is self.fleet and action not in FLEET_ACTIONS:
            return False
        if action == "rescan":  # not a key here (enter on a process says why)
            return False
        return super().check_action(action, parameters)

    # -- status

    def render_status(self) -> None:
        super().render_status()
        s = self.host_state()
        if s is None:
            return
        if s.up:
            when = "" if s.answered_at is None else f", answered {_clock(s.answered_at)}"
            took = "" if s.latency_s is None else f" in {s.latency_s * 1000:.0f} ms"
            host = f"host {s.target.name}: up{when}{took}"
            if s.from_series:  # the reason says what its own serve answered instead
                why = s.reason or "its own /snapshot.json did not answer"
                host += f" (built from Prometheus's series: {why})"
        else:
            shown = s.answered_at is not None and self.snapshot is not None
            old = f"; showing its answer of {_clock(s.answered_at)}" if shown else ""
            host = f"host {s.target.name}: {s.status} ({s.reason}){old}"
        self.status.update(Text(f"{host} · esc fleet · {self.status.content}"))


def _clock(t: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "n/a"
