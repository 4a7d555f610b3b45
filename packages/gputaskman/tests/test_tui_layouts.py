"""The TUI at the sizes people run it: what every size must keep visible, and SVG snapshots of
each source (the demo, the DRM fixture tree through the real collector, a machine with no GPU,
names that look like markup, a replayed recording) at 60×15, 80×24, 120×40 and 200×60.

GPU numbers are synthetic (the demo, fixture trees written by the tests): no GPU here. The
host sample is the demo's everywhere, so the snapshots do not depend on this machine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from gputaskman.base.readings import ModelRef, Snapshot
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot, unavailable_snapshot
from gputaskman.offline.playback import RecordSource
from gputaskman.offline.record import encode_line
from gputaskman.render import report
from gputaskman.tui.app import GtmApp, create_app
from gputaskman.tui.history import sparkline
from gputaskman.tui.replay_app import create_replay_app
from gputaskman.tui.widgets.gpu_header import SPARK_WIDTH, GpuHeader
from gputaskman.tui.widgets.process_table import ProcessTable, fit_columns
from tui_support import Fixed, settle

SIZES = [(60, 15), (80, 24), (120, 40), (200, 60)]


def markup_snapshot() -> Snapshot:
    snap = demo_snapshot()
    procs = list(snap.processes)
    procs[1] = dataclasses.replace(
        procs[1],
        name="[bold]x[/bold]",
        model=ModelRef("[red]m[/red]", "cmdline", False, "/m/[red]m[/red].gguf"),
    )
    return dataclasses.replace(snap, processes=tuple(procs))


def drm_snapshot(root: Path) -> Snapshot:
    """The DRM fixture tree through the real collector, with a fixed time and without the
    note naming the (temporary) tree."""
    from gputaskman.fixtures.drm_fixtures import write_demo_tree
    from gputaskman.sampling.collector import sysroot_collector

    write_demo_tree(root)
    c = sysroot_collector(str(root), scan_budget=None)
    try:
        snap, _ = c.sample_with_system()
    finally:
        c.close()
    notes = tuple(n for n in snap.notes if "--sysroot" not in n)
    return dataclasses.replace(snap, taken=demo_snapshot().taken, notes=notes)


@pytest.mark.parametrize("source", ["demo", "drm", "no_gpu", "markup"])
@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_layout_snapshots(snap_compare, utc, tmp_path, source, size):
    snap = {
        "demo": demo_snapshot,
        "drm": lambda: drm_snapshot(tmp_path),
        "no_gpu": unavailable_snapshot,
        "markup": markup_snapshot,
    }[source]()
    app = create_app(collector_factory=lambda: Fixed(snap), interval=60.0)
    assert snap_compare(
        app, terminal_size=size, run_before=lambda pilot: settle(pilot, app, steady=True)
    )


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_replay_layout_snapshots(snap_compare, utc, tmp_path, size):
    path = tmp_path / "run.jsonl"
    base = demo_snapshot()
    with open(path, "wb") as f:
        for i in range(3):
            f.write(
                encode_line(
                    report.to_json_dict(
                        dataclasses.replace(base, taken=base.taken + i), DemoSystem()
                    )
                )
            )
    app = create_replay_app(RecordSource.open(path), playing=False)
    assert snap_compare(
        app, terminal_size=size, run_before=lambda pilot: settle(pilot, app, steady=True)
    )


# ------------------------------------------------------------ what every size keeps


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
async def test_every_size_keeps_pid_name_vram_and_the_model_with_its_marker(size):
    """Catches the columns that matter scrolling off a narrow terminal (MODEL cut to 11
    characters at 80×24, nothing at 60×15), the sort arrow lost on a narrow column, and the
    evidence marker cut instead of the model's name."""
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), interval=60.0)
    async with app.run_test(size=size) as pilot:
        await settle(pilot, app, steady=True)
        table = app.query_one(ProcessTable)
        assert {"PID", "NAME", "VRAM", "MODEL"} <= set(table.columns_shown)
        assert "VRAM ▼" in table.labels
        model = str(table.get_row("4242@00000000:01:00.0")[table.columns_shown.index("MODEL")])
        assert model.endswith(" [mapped✓]") and model.startswith("qwen2.5-7b-q4")
        widths = sum(w + 2 for w in table.widths)  # a cell's padding, one each side
        assert widths <= size[0]  # no sideways scrolling needed
        assert table.size.height >= 4  # the header and rows of at least three processes
        header = app.query_one(GpuHeader).text.plain
        assert "▶ 0 NVIDIA" in header and "  1 NVIDIA" in header  # every GPU, one line each


def test_fit_columns_keeps_the_first_four_and_the_sort_column_then_cuts_names() -> None:
    cols = ("PID", "NAME", "GPU", "VRAM", "RAM", "CPU%", "RUNTIMES", "CATEGORY", "MODEL")
    row = (
        "4242",
        "llama-server-long-name",
        "0",
        "9.5 GiB",
        "6.0 GiB",
        "112.0",
        "CUDA",
        "LLM",
        "some-very-long-model-name-q4 [mapped✓]",
    )
    shown, limits = fit_columns(cols, [row], 200, ("VRAM", "VRAM ▼"))
    assert shown == cols and limits["MODEL"] >= len(row[8])
    shown, limits = fit_columns(cols, [row], 60, ("RAM", "RAM ▼"))
    assert shown == ("PID", "NAME", "VRAM", "RAM", "MODEL")  # the sort column stays
    assert limits["MODEL"] < len(row[8])  # cut to fit, the model's name first


def test_a_sparkline_draws_unknown_as_a_gap_never_as_zero() -> None:
    """Catches an unknown sample drawn as the lowest block, which reads as a measured 0."""
    line = sparkline([0.0, None, 50.0, 100.0], 6, top=100.0)
    assert line == "  ▁ ▅█"
    assert sparkline([None, None], 3) == "   "


async def test_the_header_keeps_history_from_the_samples_already_taken():
    """Sparklines come from the samples the TUI takes (no extra probes): one collector call
    per sample, and each GPU's series grows by one per sample."""
    fake = Fixed(demo_snapshot())
    app = create_app(collector_factory=lambda: fake, interval=60.0)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot, app, steady=True)
        for _ in range(3):
            app.action_refresh_now()
            for _ in range(100):
                await pilot.pause(0.01)
                if app.samples == fake.calls and not app._busy.locked():
                    break
        assert fake.calls == app.samples == 4
        series = app.history.memory["00000000:01:00.0"]
        assert list(series.values) == [75.0] * 4 and series.mark() == ""
        header = app.query_one(GpuHeader).text.plain
        assert "mem " + sparkline([75.0] * 4, SPARK_WIDTH, 100.0) in header


async def test_engine_load_columns_come_with_their_data_and_unknown_is_na():
    """GPU% shows while some row has a measured process utilisation (the demo's llama-server:
    87%), other rows say n/a (never 0%); with no row having one, there is no column."""
    snap = demo_snapshot()
    app = create_app(collector_factory=lambda: Fixed(snap), interval=60.0)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot, app, steady=True)
        table = app.query_one(ProcessTable)
        assert "GPU%" in table.columns_shown and "ENC%" not in table.columns_shown
        col = table.columns_shown.index("GPU%")
        assert str(table.get_row("4242@00000000:01:00.0")[col]) == "87%"
        assert str(table.get_row("5151@00000000:01:00.0")[col]) == "n/a"
    bare = dataclasses.replace(
        snap, processes=tuple(dataclasses.replace(p, engines={}) for p in snap.processes)
    )
    app = create_app(collector_factory=lambda: Fixed(bare), interval=60.0)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot, app, steady=True)
        assert "GPU%" not in app.query_one(ProcessTable).columns_shown


async def test_the_inspector_graphs_the_selected_process_vram_from_earlier_samples():
    fake = Fixed(demo_snapshot())
    app = create_app(collector_factory=lambda: fake, interval=60.0)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot, app, steady=True)
        body = str(app.query_one("#inspector-body").render())
        assert "last 1 samples" not in body and "samples:" not in body  # one sample: no graph
        app.action_refresh_now()
        for _ in range(100):
            await pilot.pause(0.01)
            if app.samples == 2:
                break
        await pilot.pause()
        body = str(app.query_one("#inspector-body").render())
        assert "VRAM last 2 samples: " + sparkline([9.5, 9.5], 2).strip() in body
        assert "(9.5 GiB–9.5 GiB)" in body


async def test_a_refresh_updates_the_table_in_place_and_shows_what_a_fresh_table_would():
    """Catches the in-place refresh (rows removed, added, updated, reordered without a
    rebuild) leaving a stale cell, a gone row or the old order behind: after each change the
    table reads as a freshly built one; and a refresh that changes nothing adds no row."""
    base = demo_snapshot()
    procs = list(base.processes)
    vram = dataclasses.replace(
        procs[1], dedicated=dataclasses.replace(procs[0].dedicated, value=20 << 30)
    )
    steps = [
        base,
        dataclasses.replace(base, processes=(procs[0], vram, *procs[2:])),  # 5151 now first
        dataclasses.replace(base, processes=(procs[0], *procs[2:])),  # 5151 gone
        dataclasses.replace(base, processes=(*procs, dataclasses.replace(procs[0], pid=4343))),
    ]
    feed = Fixed(steps[0])

    def table_text(app: GtmApp) -> list[list[str]]:
        t = app.query_one(ProcessTable)
        return [[str(c) for c in t.get_row(k)] for k in t.keys]

    app = create_app(collector_factory=lambda: feed, interval=60.0)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot, app)
        for step in steps[1:]:
            feed.snapshot = step
            app.action_refresh_now()
            for _ in range(100):
                await pilot.pause(0.01)
                if app.samples == feed.calls and not app._busy.locked():
                    break
            fresh = create_app(collector_factory=lambda s=step: Fixed(s), interval=60.0)
            async with fresh.run_test(size=(200, 60)) as fresh_pilot:
                await settle(fresh_pilot, fresh)
                assert table_text(app) == table_text(fresh)
