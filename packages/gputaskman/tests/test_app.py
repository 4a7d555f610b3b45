"""The Textual TUI: pilot tests for behaviour, snapshot tests for layout.

A fake collector feeds fixed snapshots (`gputaskman.fixtures.demo`: synthetic, not measured) so
layouts are stable; one test runs the real `Collector` on this machine.
"""

from __future__ import annotations

import threading

import pytest
from gputaskman.fixtures.demo import BUS1, DemoSystem, demo_snapshot, unavailable_snapshot
from gputaskman.tui.app import GtmApp, create_app
from gputaskman.tui.screens.help import HelpScreen
from gputaskman.tui.widgets.gpu_header import GpuHeader
from gputaskman.tui.widgets.inspector import Inspector
from gputaskman.tui.widgets.process_table import ProcessTable
from gputaskman.tui.widgets.system_panel import SystemPanel

SIZE = (120, 40)


class FakeCollector:
    """Returns a fixed snapshot; counts calls; can block until released."""

    def __init__(self, snapshot=None, system=None, gate: threading.Event | None = None):
        self.snapshot = snapshot or demo_snapshot()
        self.system = system if system is not None else DemoSystem()
        self.gate = gate
        self.calls = 0
        self.in_flight = threading.Event()
        self.closed = False

    def sample_with_system(self):
        self.calls += 1
        self.in_flight.set()
        if self.gate is not None:
            self.gate.wait(10)
        self.in_flight.clear()
        return self.snapshot, self.system

    def rescan(self, pid, create_time):
        return None  # fixed data: nothing to scan

    def close(self):
        self.closed = True


def app_with(fake: FakeCollector, **kw) -> GtmApp:
    return create_app(collector_factory=lambda: fake, interval=kw.pop("interval", 60.0), **kw)


def text_of(widget) -> str:
    return str(widget.render())


def header_text(app: GtmApp) -> str:
    return app.query_one(GpuHeader).text.plain


async def settle(pilot, app: GtmApp, samples: int = 1) -> None:
    for _ in range(200):
        await pilot.pause()
        if app.samples >= samples:
            return
        await pilot.pause(0.01)
    raise AssertionError("no sample arrived")


async def test_header_table_inspector_and_system_panel_show_the_snapshot():
    fake = FakeCollector()
    app = app_with(fake)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        header = header_text(app)
        # one line per GPU, the focused one marked, then its details
        assert "▶ 0 NVIDIA GeForce RTX 4080 SUPER" in header and "  1 NVIDIA RTX A4000" in header
        assert "12.0 GiB/16.0 GiB 75%" in header and "2.0 GiB/16.0 GiB 12%" in header
        assert "enc n/a" in header  # not supported stays n/a, never 0%
        table = app.query_one(ProcessTable)
        # selected GPU's rows plus the candidate without a GPU context; not BUS1's whisper
        assert [p.pid for p in table.rows_shown.values()] == [4242, 5151, 777, 3131]
        vram = table.columns_shown.index("VRAM")
        assert (
            str(table.get_row(table.keys[1])[vram]) == "~2.0 GiB"
        )  # inferred value keeps its marker
        assert str(table.get_row(table.keys[3])[vram]) == "n/a"
        assert "PID 4242" in text_of(app.query_one("#inspector-body"))
        assert "cpu 37.5%" in text_of(app.query_one(SystemPanel))
    assert fake.closed


async def test_inspector_follows_the_cursor_and_shows_reasons():
    app = app_with(FakeCollector())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("down")
        await pilot.pause()
        body = text_of(app.query_one("#inspector-body"))
        assert "PID 5151" in body
        assert "hidden by driver" in body and "VRAM inferred: ~2.0 GiB  [inferred" in body
        assert not app.query_one(Inspector).display  # 120 columns: the table gets them all
        await pilot.press("i")
        await pilot.pause()
        assert app.query_one(Inspector).display
        await pilot.press("i")
        await pilot.pause()
        assert not app.query_one(Inspector).display


async def test_the_inspector_shows_by_itself_only_on_a_wide_terminal():
    """Catches an inspector open on every terminal (at 120 columns it took the room the
    table's MODEL column needed) and one that ignores the user's choice on a resize."""
    app = app_with(FakeCollector())
    async with app.run_test(size=(160, 45)) as pilot:
        await settle(pilot, app)
        inspector = app.query_one(Inspector)
        assert inspector.display
        assert inspector.size.width <= 0.3 * 160  # a side panel, not 40 % of the screen
        await pilot.resize_terminal(100, 30)
        await pilot.pause()
        assert not inspector.display
        await pilot.press("i")  # the user's choice stands from now on
        await pilot.pause()
        await pilot.resize_terminal(90, 30)
        await pilot.pause()
        assert inspector.display
        await pilot.press("i")
        await pilot.pause()
        await pilot.resize_terminal(200, 60)
        await pilot.pause()
        assert not inspector.display


async def test_sorting_cycles_columns_reverses_and_keeps_unknown_last():
    app = app_with(FakeCollector())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        table = app.query_one(ProcessTable)
        await pilot.press("s")  # VRAM -> RAM
        await pilot.pause()
        assert table.sort_column == "RAM" and table.descending
        assert [p.pid for p in table.rows_shown.values()] == [4242, 5151, 777, 3131]
        await pilot.press("r")
        await pilot.pause()
        # ascending; llama-cli's RAM is unknown and stays last either way
        assert [p.pid for p in table.rows_shown.values()] == [777, 5151, 4242, 3131]
        await pilot.press("s", "s")  # RAM -> CPU% -> PID
        await pilot.pause()
        assert table.sort_column == "PID" and not table.descending
        assert [p.pid for p in table.rows_shown.values()] == [777, 3131, 4242, 5151]


async def test_switching_gpus_changes_header_and_rows():
    app = app_with(FakeCollector())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("g")
        await pilot.pause()
        assert app.adapter is not None and app.adapter.pci_bus_id == BUS1
        assert "▶ 1 NVIDIA RTX A4000" in header_text(app) and "GPU 1: " in header_text(app)
        pids = [p.pid for p in app.query_one(ProcessTable).rows_shown.values()]
        assert pids == [9001, 3131]
        # this GPU's failed graphics list is said, not hidden behind an empty table
        assert "processes.graphics query failed: Unknown Error" in header_text(app)
        await pilot.press("G")
        await pilot.pause()
        assert app.adapter.index == 0


async def test_gpu_option_selects_the_adapter_by_index():
    app = app_with(FakeCollector(), gpu=1)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        assert app.adapter.pci_bus_id == BUS1


async def test_help_screen_lists_every_key():
    app = app_with(FakeCollector())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = text_of(app.screen.query_one("#help-text"))
        for b in GtmApp.BINDINGS:
            assert b.description in text
        assert "measured by the driver" in text
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)


async def test_no_gpu_says_why_and_still_shows_system_panel():
    app = app_with(FakeCollector(unavailable_snapshot()))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        header = header_text(app)
        assert "No GPU: nvml unavailable (library not found)" in header
        # said once: the hint explains it, the library's own message is not repeated
        assert "no NVIDIA driver is installed here" in header
        assert "NVML Shared Library Not Found" not in header and header.count("nvml") == 1
        assert "ram 12.0 GiB used" in text_of(app.query_one(SystemPanel))


async def test_real_collector_on_this_machine():
    """Not faked: the default factory builds the real Collector (NVML, /proc)."""
    app = create_app(interval=60.0)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        snap = app.snapshot
        assert snap is not None
        system_text = text_of(app.query_one(SystemPanel))
        assert "RAM   used" in system_text and "GiB" in system_text
        if not snap.available:
            assert "No GPU" in header_text(app)


async def test_refresh_runs_off_the_ui_thread_and_never_piles_up():
    gate = threading.Event()
    fake = FakeCollector(gate=gate)
    app = app_with(fake, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(100):
            await pilot.pause(0.01)
            if fake.in_flight.is_set():
                break
        assert fake.in_flight.is_set()
        # the collector is blocked, yet the UI still handles keys
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert fake.in_flight.is_set() and app.samples == 0
        await pilot.pause(0.3)  # several ticks pass while the sample is blocked
        assert fake.calls == 1  # skipped, not queued
        gate.set()
        await settle(pilot, app)
        assert app.samples >= 1


async def test_pause_stops_collection_and_refresh_now_takes_one():
    fake = FakeCollector()
    app = app_with(fake, interval=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("space")
        await pilot.pause(0.1)
        calls = fake.calls
        await pilot.pause(0.3)
        assert fake.calls == calls
        assert "PAUSED" in text_of(app.query_one("#status"))
        before = app.samples
        await pilot.press("u")
        await settle(pilot, app, samples=before + 1)
        assert fake.calls == calls + 1


async def test_a_failing_collector_is_reported_not_fatal():
    class Broken(FakeCollector):
        def sample_with_system(self):
            raise OSError("boom")

    app = app_with(Broken())
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(100):
            await pilot.pause(0.01)
            if app.last_error:
                break
        assert app.last_error == "OSError: boom"
        assert "refresh failed: OSError: boom" in text_of(app.query_one("#status"))


async def test_enter_rescans_the_highlighted_process_into_the_inspector():
    from gputaskman.base.readings import ProcDetail

    class Rescanning(FakeCollector):
        def __init__(self):
            super().__init__()
            self.asked = []

        def rescan(self, pid, create_time):
            self.asked.append((pid, create_time))
            return ProcDetail(runtimes=("fresh-runtime",), scanned=True, category="video")

    fake = Rescanning()
    app = app_with(fake)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        await pilot.press("down", "down")  # Xorg, which was not scanned yet
        await pilot.pause()
        assert "scan: not scanned yet" in text_of(app.query_one("#inspector-body"))
        await pilot.press("enter")
        for _ in range(100):
            await pilot.pause(0.01)
            if fake.asked and "fresh-runtime" in text_of(app.query_one("#inspector-body")):
                break
        xorg = demo_snapshot().processes[2]
        assert fake.asked == [(777, xorg.create_time)]
        body = text_of(app.query_one("#inspector-body"))
        assert "fresh-runtime" in body and "category video" in body


async def test_drm_fixture_tree_through_the_real_collector(tmp_path):
    """Issue 8 in the TUI: the real `Collector` over a DRM fixture tree (kernel formats,
    not measured on hardware) shows the AMD and the Intel adapter, their processes with
    the right provenance, the GTT line and the Intel memory note."""
    from gputaskman.fixtures.drm_fixtures import write_demo_tree
    from gputaskman.sampling.collector import sysroot_collector

    write_demo_tree(tmp_path)
    app = create_app(interval=60.0, collector_factory=lambda: sysroot_collector(str(tmp_path)))
    async with app.run_test(size=(140, 45)) as pilot:
        await settle(pilot, app)
        header = header_text(app)
        assert "▶ 0 " in header and "GPU 0: 00000000:03:00.0" in header
        assert "5.0 GiB/16.0 GiB" in header
        assert "GTT (system memory mapped by the GPU) used 300.0 MiB / 12.0 GiB" in header
        assert "Intel memory" not in header  # that note belongs to the Intel GPU
        table = app.query_one(ProcessTable)
        rows = {p.pid: p for p in table.rows_shown.values()}
        assert set(rows) == {4100, 4200, 4300, 4301}
        vram = table.columns_shown.index("VRAM")
        assert str(table.get_row("4100@00000000:03:00.0")[vram]) == "4.0 GiB"  # measured: no mark
        assert rows[4300].dedicated.reason is not None
        assert str(rows[4300].dedicated.reason) == "shared"
        table.move_cursor(row=table.row_index("4300@00000000:03:00.0"))
        await pilot.pause()
        body = text_of(app.query_one("#inspector-body"))
        assert "VRAM (driver): n/a (shared)" in body and "held by processes 4300, 4301" in body
        await pilot.press("g")
        await pilot.pause()
        header = header_text(app)
        assert "▶ 1 " in header and "GPU 1: 00000000:00:02.0" in header
        assert "note: Intel memory:" in header and "frequency throttled (pl1)" in header
        assert "~150.0 MiB/~256.0 MiB" in header  # Intel: inferred, marked
        assert {p.pid for p in table.rows_shown.values()} == {4400}
        assert str(table.get_row("4400@00000000:00:02.0")[vram]) == "150.0 MiB"


# ----------------------------------------------------------------- layout snapshots


def _steady(app: GtmApp):
    async def run_before(pilot) -> None:
        await settle(pilot, app)
        app.last_elapsed_s = None  # wall-clock timing would make the layout flaky
        app.render_status()
        await pilot.pause()

    return run_before


def test_layout_snapshot_demo(snap_compare, utc):
    app = app_with(FakeCollector())
    assert snap_compare(app, terminal_size=SIZE, run_before=_steady(app))


def test_layout_snapshot_no_gpu(snap_compare, utc):
    app = app_with(FakeCollector(unavailable_snapshot()))
    assert snap_compare(app, terminal_size=(100, 30), run_before=_steady(app))


def test_layout_snapshot_help(snap_compare, utc):
    app = app_with(FakeCollector())
    steady = _steady(app)

    async def run_before(pilot) -> None:
        await steady(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


async def test_text_from_outside_shows_as_typed_never_as_markup():
    """Catches table cells handed to Rich as markup: the evidence marker `[mapped✓]` vanished
    from the MODEL cell and a process named `[bold]x[/bold]` showed as a bold `x`."""
    import dataclasses
    import re

    snap = demo_snapshot()
    procs = list(snap.processes)
    procs[1] = dataclasses.replace(procs[1], name="[bold]x[/bold]")
    snap = dataclasses.replace(snap, processes=tuple(procs))
    app = app_with(FakeCollector(snapshot=snap))
    async with app.run_test(size=(160, 45)) as pilot:
        await settle(pilot, app)
        shown = re.sub(r"<[^>]+>", "", app.export_screenshot()).replace("&#160;", " ")
        assert "[bold]x[/bold]" in shown
        assert "qwen2.5-7b-q4_k_m [mapped✓]" in shown  # the model with its evidence marker


def test_help_names_keys_as_typed_and_the_status_line_counts_in_english():
    """Catches Textual's key names leaking into the help (`question_mark` for `?`) and a
    status line saying "1 processes"."""
    from gputaskman.tui.screens.help import help_text, key_label

    assert key_label("question_mark") == "?" and key_label("escape") == "esc"
    assert key_label("g") == "g" and key_label("G") == "G"
    text = help_text(GtmApp.BINDINGS)
    assert "question_mark" not in text and "  ?  " in text


async def test_the_status_line_says_one_process():
    import dataclasses

    snap = demo_snapshot()
    snap = dataclasses.replace(snap, processes=snap.processes[:1])
    app = app_with(FakeCollector(snapshot=snap))
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot, app)
        status = text_of(app.query_one("#status"))
        assert "1 process ·" in status and "processes" not in status


def _bottom_line(svg: str) -> str:
    """The last row of an exported screenshot as plain text (segments joined in order)."""
    import html
    import re

    rows: dict[float, list[tuple[float, str]]] = {}
    pattern = r'<text class="[^"]*" x="([\d.]+)" y="([\d.]+)"[^>]*>([^<]*)</text>'
    for m in re.finditer(pattern, svg):
        rows.setdefault(float(m.group(2)), []).append((float(m.group(1)), m.group(3)))
    last = sorted(rows[max(rows)])
    return "".join(html.unescape(t) for _, t in last).replace("\xa0", " ")


@pytest.mark.parametrize("size", [(60, 15), (80, 24)])
async def test_the_footer_always_says_where_every_key_is(size):
    """Catches a footer cut off mid-word with no sign that more keys exist (`u refre▏` at 80
    columns): "? all keys" comes right after quit, and the rest are in the help screen."""
    app = app_with(FakeCollector())
    async with app.run_test(size=size) as pilot:
        await settle(pilot, app)
        assert "? all keys" in _bottom_line(app.export_screenshot())
    shown = [b.key for b in type(app).BINDINGS if b.show]
    assert shown[:2] == ["q", "question_mark"]
