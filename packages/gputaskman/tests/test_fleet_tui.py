"""The fleet TUI: SVG snapshots of the fleet table and of a host's view at 80×24 and 200×60,
and pilot tests of what the keys do: sort, reverse, filter, enter into a host's live view and
esc back, a host that goes down while open, a host that never answered; and of a refresh: it
builds the cells of the rows on screen only (2,000 rows), and the cursor stays on its GPU when
the rows reorder.

The fleet is a fixed source of host states made from a fleet document (`output.states_of`):
the demo snapshot, a DRM fixture recording and a demo recording as three hosts that are up
(synthetic GPU numbers), and three that are not (unreachable, refused, another schema
version). No network: the poller's own tests run real hosts.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from gputaskman.base.readings import Reading
from gputaskman.document.fleetdoc import HostStatus, fleet_json, host_json
from gputaskman.document.reader import read_table_document
from gputaskman.fixtures.demo import TAKEN, DemoSystem, demo_snapshot
from gputaskman.fleet.output import states_of
from gputaskman.fleet.poller import HostState
from gputaskman.fleet.promapi import PromClient, parse_url
from gputaskman.fleet.promfleet import PromFleet
from gputaskman.fleet.source import FixedSource
from gputaskman.fleet.view import ViewCache, fleet_rows, fleet_totals, render_text, sort_value
from gputaskman.render import report
from gputaskman.tui.fleet_app import FleetApp
from gputaskman.tui.screens.fleet import FleetScreen
from gputaskman.tui.screens.fleet_help import fleet_help_text
from gputaskman.tui.screens.help import HelpScreen
from prom_helpers import fake_prometheus, recorded
from terminal_screen import Terminal
from textual.widgets import Static

HERE = Path(__file__).parent
SIZES = [(80, 24), (200, 60)]


def fleet_doc() -> dict:
    demo = json.loads(json.dumps(report.to_json_dict(demo_snapshot(), DemoSystem())))
    drm = json.loads((HERE / "recordings" / "drm.jsonl").read_text().splitlines()[0])
    rec = json.loads((HERE / "recordings" / "demo.jsonl").read_text().splitlines()[-1])

    def host(name, status, reason=None, snap=None, answered=TAKEN, latency=0.012):
        return host_json(
            name=name,
            address=f"{name}:9835",
            url=f"http://{name}:9835/snapshot.json",
            status=status,
            reason=reason,
            latency_s=latency if snap is not None else None,
            answered=answered if snap is not None else None,
            snapshot=snap,
        )

    hosts = [
        host("gpu-node-01", HostStatus.UP, snap=demo),
        host("gpu-node-02", HostStatus.UP, snap=drm, latency=0.031),
        host("gpu-node-03", HostStatus.UNREACHABLE, "connection refused"),
        host("gpu-node-04", HostStatus.REFUSED, "the host did not accept the token (HTTP 401)"),
        host("gpu-node-05", HostStatus.UP, snap=rec, latency=0.008),
        host(
            "gpu-node-06",
            HostStatus.INCOMPATIBLE,
            "schema_version 2 is not supported (this gputaskman reads 1)",
        ),
    ]
    return fleet_json(hosts, {}, taken=TAKEN, interval_s=1.0, timeout_s=2.0)


class FixedFleet(FixedSource):
    """A saved fleet whose timer never fires on its own during a test."""

    def __init__(self, states: tuple[HostState, ...]) -> None:
        super().__init__(states, interval=60.0)


def _app() -> tuple[FleetApp, FixedFleet]:
    src = FixedFleet(states_of(fleet_doc()))
    return FleetApp(src), src


async def _settle(pilot) -> None:
    for _ in range(5):
        await pilot.pause()


def _table_text(app: FleetApp) -> list[str]:
    t = app.fleet.table
    return [" | ".join(str(c) for c in t.get_row(k)) for k in t.keys]


# ------------------------------------------------------------------------- snapshots


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_fleet_layout_snapshots(snap_compare, utc, size):
    app, _ = _app()
    assert snap_compare(app, terminal_size=size, run_before=_settle)


def _prometheus_app() -> FleetApp:
    """The fleet as a real Prometheus answered it (recorded: test_fleet_promapi.py), read by
    the real client from a loopback server; the server's address in the status line is
    named as a user would see it, not by the test's random port."""
    answers = json.loads((HERE / "recordings" / "prometheus_answers.json").read_text())
    with fake_prometheus(recorded(answers)) as fake:
        source = PromFleet(PromClient(fake.url), interval=60.0)
        source.refresh()
    source.client.endpoint = parse_url("http://prometheus.example:9090")
    return FleetApp(source)


async def test_enter_on_a_prometheus_host_reads_it_whole_and_says_where_it_came_from(utc):
    """Catches a drill-down that keeps showing the table's few series (no temperature, no
    clocks), or one that does not say the view was built from Prometheus's series."""
    # the hosts renamed to closed loopback ports: the direct poll of the opened host must
    # reach nobody (and fail, so the view stays the one from Prometheus)
    text = (HERE / "recordings" / "prometheus_answers.json").read_text()
    answers = json.loads(re.sub(r"gpu-node-0(\d):9835", r"127.0.0.1:\1", text))
    with fake_prometheus(recorded(answers)) as fake:
        source = PromFleet(PromClient(fake.url), interval=60.0, table_only=True)
        source.refresh()
        app = FleetApp(source)
        try:
            async with app.run_test(size=(200, 60)) as pilot:
                await _settle(pilot)
                await pilot.press("enter")
                await _settle(pilot)
                assert app.host_name == "127.0.0.1:1"
                source.refresh()  # the round the focus woke
                app.request_refresh()
                await _settle(pilot)
                state = app.host_state()
                assert state.from_series and state.document.adapters[0].metrics.temperature_c.value
                assert "built from Prometheus's series" in str(app.status.content)
                await pilot.press("escape")
                await _settle(pilot)
                assert app.host_name is None and source._focus_name is None
        finally:
            source.stop()


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_fleet_from_prometheus_layout_snapshots(snap_compare, utc, size):
    assert snap_compare(_prometheus_app(), terminal_size=size, run_before=_settle)


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_host_view_layout_snapshots(snap_compare, utc, size):
    app, _ = _app()

    async def open_first_host(pilot) -> None:
        await _settle(pilot)
        await pilot.press("enter")
        await _settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=open_first_host)


# ------------------------------------------------------------------------- pilot


async def test_hosts_that_are_not_up_show_their_reason_and_no_number(utc):
    """Catches a down host drawn with zeros or with its last numbers as if current."""
    app, _ = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        rows = _table_text(app)
        assert len(rows) == 2 + 2 + 1 + 1 + 2 + 1  # GPUs of the hosts up, one row per other
        for name, says in (
            ("gpu-node-03", "unreachable: connection refused"),
            ("gpu-node-04", "refused: the host did not accept"),
            ("gpu-node-06", "incompatible: schema_version 2 is not supported"),
        ):
            row = next(r for r in rows if r.startswith(name))
            assert says in " ".join(row.replace(" | ", " ").split())  # read across the cells
            assert "GiB" not in row and "%" not in row and "█" not in row
            shown = next(r for r in app.fleet.table.rows_shown.values() if r.host == name)
            assert shown.memory_used is None and shown.util is None
        summary = str(app.fleet.summary.content)
        assert summary.startswith("hosts 3/6 up (1 incompatible, 1 refused, 1 unreachable)")


async def test_sort_and_reverse_keep_unknowns_last(utc):
    """Catches a sort that puts a down host (no memory) first, or between known values."""
    app, _ = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        await pilot.press("s")  # HOST -> MEMORY, descending
        await _settle(pilot)
        t = app.fleet.table
        assert (t.sort_column, t.descending) == ("MEMORY", True)
        shown = list(t.rows_shown.values())
        used = [sort_value(r, "MEMORY") for r in shown]
        known = [u for u in used if u is not None]
        assert known == sorted(known, reverse=True) and used[len(known) :] == [None] * 3
        assert "sort MEMORY ▼" in str(app.fleet.status.content)
        await pilot.press("r")
        await _settle(pilot)
        used = [sort_value(r, "MEMORY") for r in t.rows_shown.values()]
        known = [u for u in used if u is not None]
        assert known == sorted(known) and used[len(known) :] == [None] * 3
        assert "sort MEMORY ▲" in str(app.fleet.status.content)


async def test_filter_narrows_the_rows_live_and_esc_clears_it(utc):
    app, _ = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        everything = len(app.fleet.table.rows_shown)
        await pilot.press("slash", *"qwen")
        await _settle(pilot)
        rows = list(app.fleet.table.rows_shown.values())
        assert rows and all("qwen" in r.models for r in rows)
        assert len(rows) < everything
        await pilot.press("enter")  # keeps the filter, back to the table
        await pilot.press("escape")
        await _settle(pilot)
        assert len(app.fleet.table.rows_shown) == everything
        await pilot.press("slash", *"http 401")
        await _settle(pilot)
        assert [r.host for r in app.fleet.table.rows_shown.values()] == ["gpu-node-04"]


async def test_the_filter_finds_a_process_by_its_command_line(utc):
    """Catches a filter that reads only what the cells show: ``/vllm`` did not find the GPU
    where ``python -m vllm.entrypoints.openai.api_server`` runs (its name is python3, and it
    need not be among the few processes its cell names). Each host's document is read as the
    TUI's poller reads it: the table's part only."""
    doc = fleet_doc()
    snap = doc["hosts"][0]["snapshot"]  # gpu-node-01: the demo
    proc = next(p for p in snap["processes"] if p["pid"] == 5151)
    proc["cmdline"] = ["python", "-m", "vllm.entrypoints.openai.api_server", "--port", "8000"]
    states = tuple(
        s
        if s.body is None
        else dataclasses.replace(s, document=read_table_document(s.body), whole=False)
        for s in states_of(doc)
    )
    app = FleetApp(FixedFleet(states))
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        await pilot.press("slash", *"vllm")
        await _settle(pilot)
        t = app.fleet.table
        rows = list(t.rows_shown.values())
        assert [(r.host, r.adapter.pci_bus_id if r.adapter else None) for r in rows] == [
            ("gpu-node-01", "00000000:01:00.0")
        ]
        assert "vllm" not in rows[0].processes + rows[0].models  # no cell says it
        assert t.render_line(1).text.split()[0] == "gpu-node-01"  # drawn
        assert "filter 'vllm': 1 rows shown" in str(app.fleet.status.content)


async def test_enter_opens_the_host_live_view_and_esc_comes_back(utc):
    """Catches a drill-down that shows the wrong host, stays on a stale document when a new
    one arrives, or cannot get back to the fleet."""
    app, src = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        assert isinstance(app.screen, FleetScreen)
        await pilot.press("down", "down", "enter")  # the third row: gpu-node-02's first GPU
        await _settle(pilot)
        assert not isinstance(app.screen, FleetScreen) and app.host_name == "gpu-node-02"
        state = next(s for s in src.states() if s.target.name == "gpu-node-02")
        assert app.snapshot is not None
        assert {a.pci_bus_id for a in app.snapshot.adapters} == {
            a.pci_bus_id for a in state.document.adapters
        }
        assert "host gpu-node-02: up" in str(app.status.content)
        assert app.samples == 1

        newer = dataclasses.replace(state, seq=state.seq + 1, answered_at=TAKEN + 1)
        src.set(tuple(newer if s is state else s for s in src.states()))
        app.request_refresh()
        await _settle(pilot)
        assert app.samples == 2  # one sample per new document, not per tick
        app.request_refresh()
        await _settle(pilot)
        assert app.samples == 2

        down = dataclasses.replace(
            newer, status=HostStatus.UNREACHABLE, reason="connection refused"
        )
        src.set(tuple(down if s is newer else s for s in src.states()))
        app.request_refresh()
        await _settle(pilot)
        status = str(app.status.content)
        assert "host gpu-node-02: unreachable (connection refused)" in status
        assert "showing its answer of 00:53:21" in status

        await pilot.press("escape")
        await _settle(pilot)
        assert isinstance(app.screen, FleetScreen) and app.host_name is None


def _data_lines(term: Terminal) -> list[str]:
    """The terminal's lines under the fleet table's header, as drawn."""
    lines = term.lines()
    head = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("HOST"))
    return lines[head + 1 :]


async def test_back_from_a_host_the_fleet_is_drawn_again_and_its_keys_redraw_it(utc):
    """Catches a fleet screen that Textual never draws again once it has been popped for a
    host's view and pushed back (its update timer died with it): the host view stayed on the
    terminal after esc, s, u and new answers redrew nothing, ? drew the fleet behind the help
    and closing the help left the help box drawn. What is checked is what reached the
    terminal (`terminal_screen`), waiting on the app's own timers: a pilot's pause() redraws
    the screen itself, which hid this bug from every other test here."""
    app, src = _app()
    term = Terminal(200, 60)
    app.driver_class = term.driver()
    async with app.run_test(size=(200, 60), headless=False) as pilot:
        await term.shows("hosts 3/6 up", "HOST ▲")
        for _ in range(2):  # open and back twice: each back draws the fleet
            await pilot.press("enter")
            await term.shows("host gpu-node-01: up")
            assert app.screen is not app.fleet
            await pilot.press("escape")
            await term.shows("hosts 3/6 up", "HOST ▲")
            await term.lacks("host gpu-node-01: up", "esc fleet")
            assert app.screen is app.fleet and app.host_name is None

        await pilot.press("s")  # sort by MEMORY used, most first
        await term.shows("MEMORY ▼", "sort MEMORY ▼")
        t = app.fleet.table
        order = [r.host for r in t.rows_shown.values()]
        assert order[0] == "gpu-node-05"  # 12.5 GiB used
        drawn = _data_lines(term)
        assert [ln.split()[0] for ln in drawn[:2]] == order[:2]  # drawn in the table's order

        await pilot.press("u")  # poll now: the source is asked, the next tick draws its answer
        assert src.polled == 1
        row = t.current()
        assert row is not None and row.adapter is not None
        newer = _with_used(row.state, row.adapter.pci_bus_id, 2**20)
        src.set(tuple(newer if s is row.state else s for s in src.states()))
        app.request_refresh()
        await term.shows(" 1.0 MiB/16.0 GiB 0%")

        await pilot.press("question_mark")
        await term.shows("gputaskman fleet keys", "MEMORY ▼")
        await pilot.press("escape")
        await term.lacks("gputaskman fleet keys", "closes this help")
        await term.shows("MEMORY ▼", "hosts 3/6 up")
        assert app.screen is app.fleet


async def test_a_host_that_never_answered_has_no_view_to_open(utc):
    app, _ = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        app.drill("gpu-node-03")
        await _settle(pilot)
        assert isinstance(app.screen, FleetScreen) and app.host_name is None


async def test_the_fleet_table_has_its_own_keys_and_the_host_view_cannot_signal(utc):
    """Catches the host view's keys (g, i, k) acting under the fleet table, and a signal key
    on a remote host's processes."""
    app, src = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        assert app.check_action("next_gpu", ()) is False
        assert app.check_action("quit", ()) is not False
        await pilot.press("u")
        assert src.polled == 1
        await pilot.press("enter")
        await _settle(pilot)
        assert app.check_action("signal", ()) is False  # read-only
        assert app.check_action("next_gpu", ()) is not False


async def test_a_host_view_s_help_says_what_its_keys_do_here(utc):
    """Catches the host view's help promising what a key does in the single-host TUI only:
    enter rescanning a process (a fleet host's serve scans its own: enter only says so), u
    "refresh now" without asking the hosts (it polls now, as u on the fleet table)."""
    app, src = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        await pilot.press("enter")
        await _settle(pilot)
        await pilot.press("question_mark")
        await _settle(pilot)
        assert isinstance(app.screen, HelpScreen)
        text = str(app.screen.query_one("#help-text", Static).render())
        keys = {ln.split()[0]: ln.split(None, 1)[1] for ln in text.splitlines()[1:16] if ln}
        assert "⏎" not in keys and "rescan" not in text
        assert keys["u"] == "poll every host now"
        assert keys["esc"] == "clear the filter, else back to the fleet"
        await pilot.press("escape", "u")
        await _settle(pilot)
        assert src.polled == 1


def _renamed(s: HostState, name: str) -> HostState:
    return dataclasses.replace(s, target=dataclasses.replace(s.target, name=name))


def _with_used(s: HostState, bus: str, used: int) -> HostState:
    """`s` with GPU `bus` using `used` bytes (a newer document, as the poller would hold)."""
    doc = s.document
    assert doc is not None
    adapters = tuple(
        dataclasses.replace(
            a,
            metrics=dataclasses.replace(a.metrics, memory_used_bytes=Reading.measured(used, "t")),
        )
        if a.pci_bus_id == bus and a.metrics is not None
        else a
        for a in doc.adapters
    )
    return dataclasses.replace(
        s, document=dataclasses.replace(doc, adapters=adapters), seq=s.seq + 1
    )


async def test_a_refresh_builds_the_cells_of_the_rows_on_screen_only(utc):
    """Catches a fleet table that builds every row's cells on each refresh (a DataTable did:
    with 2,000 GPUs that was most of a refresh's cost), counted by the table's `rows_built`;
    and a table that does not draw the rows the cursor scrolls to."""
    one = states_of(fleet_doc())[0]  # gpu-node-01: two GPUs
    states = tuple(_renamed(one, f"node-{i:04d}") for i in range(1000))
    src = FixedFleet(states)
    app = FleetApp(src)
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        t = app.fleet.table
        assert t.row_count == 2000
        src.set(tuple(_with_used(s, "00000000:01:00.0", 2**30) for s in reversed(states)))
        app.request_refresh()
        await _settle(pilot)
        on_screen = len(t.visible_range())
        assert 20 < on_screen < 60  # a screenful was drawn ...
        assert 0 < t.rows_built <= on_screen  # ... and only its rows were built
        assert " 1.0/16.0 GiB 6%" in t.render_line(1).text
        await pilot.press("end")  # the view follows the cursor to the last row
        await _settle(pilot)
        assert t.current_key() == "node-0999|00000000:41:00.0"
        assert t.rows_built <= 2 * on_screen
        y = t.cursor_row - t.visible_range().start + 1  # the header is line 0
        assert "node-0999" in t.render_line(y - 1).text  # the host, on its first GPU's row


async def test_the_cursor_stays_on_its_gpu_when_a_refresh_reorders_the_rows(utc):
    """Catches a refresh that leaves the cursor at its place in the table, on another host's
    GPU, when new numbers move the highlighted GPU's row."""
    app, src = _app()
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        await pilot.press("s", "down")  # by MEMORY used, most first; one row down
        await _settle(pilot)
        t = app.fleet.table
        row = t.current()
        assert row is not None and row.adapter is not None and row.adapter.pci_bus_id
        key, before = row.key, t.cursor_row
        # that GPU now uses the least memory: its row moves down past the others
        newer = _with_used(row.state, row.adapter.pci_bus_id, 2**20)
        src.set(tuple(newer if s is row.state else s for s in src.states()))
        app.request_refresh()
        await _settle(pilot)
        assert t.current_key() == key and t.cursor_row > before
        assert t.current() is not None and t.current().memory_used.value == 2**20
        assert " 1.0 MiB/16.0 GiB 0%" in t.render_line(t.cursor_row + 1).text  # highlighted
        assert str(app.fleet.status.content).startswith(f"{row.host}: up")


def test_the_fleet_help_explains_every_column_and_status():
    text = fleet_help_text(list(FleetScreen.BINDINGS))
    for word in ("unreachable", "slow", "refused", "incompatible", "MODELS", "apart"):
        assert word in text
    keys = [ln.split()[0] for ln in text.splitlines()[1:9]]
    assert keys == ["q", "?", "⏎", "s", "r", "/", "esc", "u"]  # as typed: "/", not "slash"


def test_once_keeps_the_columns_to_their_data_and_says_a_long_reason_whole():
    """Catches ``fleet --once`` padding every row's GPU column to one unreachable host's
    reason (about 135 characters), or cutting that reason short."""
    states = states_of(fleet_doc())
    why = "no connection within 2 s: " + "the resolver said a long thing " * 4 + "(end)"
    states = tuple(
        dataclasses.replace(s, reason=why) if s.target.name == "gpu-node-03" else s for s in states
    )
    text = render_text(states).splitlines()
    without = render_text(tuple(s for s in states if s.target.name != "gpu-node-03"))
    # every other line (the header, each GPU row) as if that host were not there
    assert [ln for ln in text[1:] if not ln.startswith("gpu-node-03")] == without.splitlines()[1:]
    head = text[2]
    assert head.index("MEMORY") - head.index("GPU") < 40  # the GPU names' width
    line = next(ln for ln in text if ln.startswith("gpu-node-03"))
    assert line.split(None, 1)[1] == f"unreachable: {why}"  # whole, on its host's line


def test_rows_of_a_fleet_document_round_trip_through_states_of():
    states = states_of(fleet_doc())
    assert [s.target.name for s in states][:2] == ["gpu-node-01", "gpu-node-02"]
    assert states[2].status is HostStatus.UNREACHABLE and states[2].document is None
    rows = fleet_rows(states)
    assert sum(r.adapter is not None for r in rows) == 6


async def test_a_host_document_the_live_view_cannot_show_is_said_not_crashed(utc):
    """A document can be read and still not be a `Snapshot` (a GPU without an address): the
    host view says so in its status line instead of taking the app down."""
    doc = fleet_doc()
    snap = doc["hosts"][0]["snapshot"]
    snap["adapters"][0]["pci_bus_id"] = None
    app = FleetApp(FixedFleet(states_of(doc)))
    async with app.run_test(size=(200, 60)) as pilot:
        await _settle(pilot)
        await pilot.press("enter")
        await _settle(pilot)
        assert app.host_name == "gpu-node-01" and app.snapshot is None
        assert "gpu-node-01's document cannot be shown" in str(app.status.content)


def test_the_row_cache_rebuilds_only_changed_hosts_and_never_serves_stale_rows():
    """Catches a cache that rebuilds every host on every refresh (2,000 hosts a second), or
    one that keeps a host's rows after its state changed (a host that went down would still
    show its numbers)."""
    states = states_of(fleet_doc())
    cache = ViewCache()
    first = fleet_rows(states, cache=cache)
    assert first == fleet_rows(states)
    again = fleet_rows(states, cache=cache)
    assert all(a is b for a, b in zip(first, again, strict=True))
    down = dataclasses.replace(states[0], status=HostStatus.UNREACHABLE, reason="gone")
    changed = fleet_rows((down, *states[1:]), cache=cache)
    assert changed[0].status is HostStatus.UNREACHABLE and "gone" in changed[0].gpu
    assert changed[0].memory_used is None
    n0 = len([r for r in first if r.host == states[0].target.name])
    assert all(a is b for a, b in zip(first[n0:], changed[1:], strict=True))
    assert fleet_rows(states[1:], cache=cache) == fleet_rows(states[1:])
    assert set(cache.rows) == {s.target.name for s in states[1:]}


def test_cached_totals_follow_every_change():
    """Catches cached sums kept after a host's state changed (a host gone down would still
    count in the fleet's memory)."""
    states = states_of(fleet_doc())
    cache = ViewCache()
    assert fleet_totals(states, cache) == fleet_totals(states)
    down = dataclasses.replace(states[0], status=HostStatus.UNREACHABLE, reason="gone")
    changed = (down, *states[1:])
    assert fleet_totals(changed, cache) == fleet_totals(changed) != fleet_totals(states)
    assert fleet_totals(states[2:], cache) == fleet_totals(states[2:])
