"""`gputaskman replay`: the `Playback` clock without a terminal, the record-file scan (cut
and malformed lines), and the replay TUI through Textual's pilot. GPU frames are mocked
NVML snapshots; one file comes from a real `gputaskman record` run."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from gputaskman.offline import record
from gputaskman.offline.playback import SPEEDS, Playback, RecordSource
from gputaskman.offline.recordfile import SnapshotError, iter_record
from gputaskman.render import report
from gputaskman.tui.replay_app import create_replay_app
from gputaskman.tui.widgets.gpu_header import GpuHeader
from gputaskman.tui.widgets.process_table import ProcessTable
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(
    "mocked_snapshots", Path(__file__).with_name("mocked_snapshots.py")
)
ms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ms)
GIB = ms.GIB


def gtm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gputaskman.cli", *args], capture_output=True, text=True, timeout=60
    )


def frame(t: float, used_gib: float, procs=()) -> dict:
    a = ms.adapter()
    return ms.doc(
        ms.snapshot(
            ms.T0 + t,
            adapters=[a],
            metrics_by_bus={a.pci_bus_id: ms.metrics(used=int(used_gib * GIB))},
            procs=procs,
        )
    )


# ---------------------------------------------------------------------------- Playback


def test_recorded_time_is_used_when_strictly_increasing() -> None:
    pb = Playback([100.0, 100.5, 102.0, 110.0])
    assert pb.recorded_time and pb.time_label == "recorded time"
    assert pb.times == [0.0, 0.5, 2.0, 10.0] and pb.duration == 10.0


@pytest.mark.parametrize("taken", [[5.0, 6.0, 6.0, 7.0], [5.0, 9.0, 7.0]])
def test_other_times_play_one_second_per_snapshot_labelled(taken) -> None:
    pb = Playback(taken)
    assert not pb.recorded_time and pb.time_label.startswith("not recorded time")
    assert pb.times == [float(i) for i in range(len(taken))]


def test_advance_moves_by_wall_time_times_speed_and_stops_at_the_end() -> None:
    pb = Playback([0.0, 1.0, 2.0, 3.0, 10.0])
    assert pb.advance(5.0) is False and pb.position == 0  # paused: nothing moves
    pb.play()
    pb.set_speed(2.0)
    assert pb.advance(0.75) is True and pb.position == 1.5 and pb.index == 1
    assert pb.advance(0.2) is False and pb.index == 1  # 1.9 s: still the frame at 1 s
    pb.advance(100.0)
    assert pb.position == 10.0 and pb.index == 4 and not pb.playing
    pb.play()  # from the end, play starts over
    assert pb.playing and pb.position == 0.0 and pb.index == 0


def test_step_pauses_and_clamps() -> None:
    pb = Playback([0.0, 1.0, 5.0])
    pb.play()
    assert pb.step(1) == 1 and not pb.playing and pb.position == 1.0
    assert pb.step(5) == 2 and pb.position == 5.0
    assert pb.step(-10) == 0 and pb.position == 0.0


def test_seek_variants_clamp_and_pick_the_frame_at_or_before() -> None:
    pb = Playback([0.0, 1.0, 5.0, 9.0])
    assert pb.seek(4.99) == 1
    assert pb.seek(5.0) == 2
    assert pb.seek(-3) == 0 and pb.position == 0
    assert pb.seek(99) == 3 and pb.position == 9.0
    assert pb.seek(2.0) == 1 and pb.seek_by(3.0) == 2 and pb.seek_by(-10) == 0
    assert pb.seek_fraction(0.5) == 1 and pb.position == 4.5
    assert pb.seek_fraction(2.0) == 3
    assert pb.seek_index(2) == 2 and pb.seek_index(-1) == 0
    with pytest.raises(ValueError):
        pb.seek(math.nan)


def test_speed_steps_and_limits() -> None:
    pb = Playback([0.0, 1.0])
    assert pb.faster() == 2.0 and pb.slower() == 1.0 and pb.slower() == 0.5
    for _ in range(20):
        pb.faster()
    assert pb.speed == SPEEDS[-1]
    for _ in range(20):
        pb.slower()
    assert pb.speed == SPEEDS[0]
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError):
            pb.set_speed(bad)


def test_one_snapshot_and_none() -> None:
    pb = Playback([7.0])
    pb.play()
    assert not pb.playing and pb.duration == 0 and pb.index == 0
    with pytest.raises(ValueError):
        Playback([])


# ---------------------------------------------------------------------------- files


def test_a_file_cut_mid_line_skips_only_the_last_line(tmp_path: Path) -> None:
    docs = [frame(t, t + 1) for t in range(3)]
    path = ms.write_record(tmp_path / "r.jsonl", docs)
    whole = path.read_bytes()
    path.write_bytes(whole + record.encode_line(frame(3, 4))[:-30])  # killed mid-write
    src = RecordSource.open(path)
    assert len(src.frames) == 3 and src.report.malformed == ()
    assert src.report.incomplete_last_line == 4
    assert "incomplete last line 4" in src.report.lines()[0]
    # a last line that only lost its newline is whole, and kept
    path.write_bytes(whole + record.encode_line(frame(3, 4))[:-1])
    src = RecordSource.open(path)
    assert len(src.frames) == 4 and src.report.incomplete_last_line is None


def test_malformed_lines_are_skipped_and_reported(tmp_path: Path) -> None:
    broken = frame(1.5, 9)
    broken["processes"] = [{"pid": "not a pid"}]  # JSON and a snapshot header, bad inside
    nan_line = record.encode_line(frame(1.7, 9)).replace(b'"value":60', b'"value":NaN')
    docs = [frame(0, 1), "garbage\n", frame(1, 2), broken, nan_line, "\n", frame(2, 3)]
    path = ms.write_record(tmp_path / "r.jsonl", docs)
    src = RecordSource.open(path)
    # lines that are not snapshot JSON are reported up front ...
    assert [f.lineno for f in src.frames] == [1, 3, 4, 7]
    assert [n for n, _ in src.report.malformed] == [2, 5, 6]
    assert src.report.lines()[0].startswith("skipped 3 malformed line(s): 2, 5, 6")
    assert src.malformed_count == 3
    # ... one whose content cannot be shown when it is first loaded
    with pytest.raises(SnapshotError, match="pid"):
        src.load(2)
    assert src.malformed_count == 4 and "pid" in src.late_malformed[2]
    # frames come back as the snapshots that were recorded
    snap, system = src.load(1)
    assert report.to_json_dict(snap, system, None) == frame(1, 2)
    assert snap.metrics[ms.BUS0].memory_used_bytes.value == 2 * GIB


def test_a_real_record_file_replays(tmp_path: Path) -> None:
    rec = tmp_path / "real.jsonl"
    assert gtm("record", str(rec), "--interval", "0.1", "--count", "3").returncode == 0
    src = RecordSource.open(rec)
    pb = src.playback()
    assert len(src.frames) == 3 and pb.recorded_time
    docs = [json.loads(x) for x in rec.read_text().splitlines()]
    for i, doc in enumerate(docs):
        snap, system = src.load(i)
        assert not snap.available
        assert report.to_json_dict(snap, system, doc["selected_gpu"]) == doc
        assert system.render_lines()[0].startswith("RAM   used")


def test_replay_command_line_without_a_terminal(tmp_path: Path) -> None:
    path = ms.write_record(tmp_path / "r.jsonl", [frame(0, 1), "bad\n", frame(1, 2)])
    res = gtm("replay", str(path))
    assert res.returncode == 2 and "needs a terminal" in res.stderr
    assert "skipped 1 malformed line(s): 2" in res.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert gtm("replay", str(empty)).returncode == 1
    assert gtm("replay", str(tmp_path / "missing")).returncode == 2


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=3000))
@example(b"null")  # a JSON null line was taken for no line at all: its bytes went unreported
@example(b"{}\nnull\n[]")
def test_record_reader_fuzz(tmp_path: Path, data: bytes) -> None:
    """Every byte of any input is in exactly one entry, and each entry is a snapshot or says
    why it is not (a line is never dropped without a word)."""
    import io

    entries = list(iter_record(io.BytesIO(data)))
    assert sum(e.length for e in entries) == len(data)
    assert all((e.doc is None) == (e.error is not None) for e in entries)
    assert all(not e.incomplete for e in entries[:-1])
    path = tmp_path / "f.jsonl"
    path.write_bytes(record.encode_line(frame(0, 1)) + data)
    src = RecordSource.open(path)
    assert src.frames and src.frames[0].lineno == 1


# ---------------------------------------------------------------------------- TUI


def header_text(app) -> str:
    return app.query_one(GpuHeader).text.plain


def status_text(app) -> str:
    return str(app.status.render())


async def test_replay_tui_plays_steps_seeks_and_changes_speed(tmp_path: Path) -> None:
    procs = [ms.proc(4242, 3 * GIB)]
    path = ms.write_record(
        tmp_path / "r.jsonl", [frame(0, 1, procs), frame(1, 2, procs), frame(2, 3)]
    )
    app = create_replay_app(RecordSource.open(path), playing=False)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause()
        assert "1.0 GiB/16.0 GiB" in header_text(app)
        assert "snapshot 1/3" in status_text(app) and "recorded time" in status_text(app)
        assert [p.pid for p in app.query_one(ProcessTable).rows_shown.values()] == [4242]
        await pilot.press("full_stop")
        await pilot.pause()
        assert "2.0 GiB/16.0 GiB" in header_text(app) and "snapshot 2/3" in status_text(app)
        await pilot.press("full_stop")
        await pilot.pause()
        assert "3.0 GiB" in header_text(app)
        assert app.query_one(ProcessTable).rows_shown == {}  # the process is gone in frame 3
        await pilot.press("comma", "comma")
        await pilot.pause()
        assert "1.0 GiB/16.0 GiB" in header_text(app)
        await pilot.press("5")  # 50 % of 2 s: the frame at 1 s
        await pilot.pause()
        assert app.playback.index == 1 and "2.0 GiB/16.0 GiB" in header_text(app)
        await pilot.press("plus", "plus")
        await pilot.pause()
        assert app.playback.speed == 4.0 and "4x" in status_text(app)
        await pilot.press("minus")
        await pilot.pause()
        assert app.playback.speed == 2.0
        await pilot.press("space")
        for _ in range(100):  # 1 s of recording at 2x: about half a second of wall time
            await pilot.pause(0.05)
            if app.playback.at_end:
                break
        assert app.playback.index == 2 and not app.playback.playing
        assert "3.0 GiB/16.0 GiB" in header_text(app)
        assert "paused" in status_text(app)
    assert app._collector is None  # replay never created a collector


async def test_replay_tui_skips_a_frame_it_cannot_show(tmp_path: Path) -> None:
    broken = frame(1, 9)
    broken["adapters"][0]["metrics"]["memory_used_bytes"] = {"value": None}
    path = ms.write_record(tmp_path / "r.jsonl", [frame(0, 1), broken, frame(2, 3)])
    app = create_replay_app(RecordSource.open(path), playing=False)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause()
        await pilot.press("full_stop")
        await pilot.pause()
        # the previous frame stays; the status says which line was skipped and why
        assert "1.0 GiB/16.0 GiB" in header_text(app)
        assert "snapshot 2 (line 2) skipped" in status_text(app)
        assert "1 malformed line(s) skipped" in status_text(app)
        await pilot.press("full_stop")
        await pilot.pause()
        assert "3.0 GiB/16.0 GiB" in header_text(app)


async def test_replay_tui_labels_time_that_was_not_recorded(tmp_path: Path) -> None:
    path = ms.write_record(tmp_path / "r.jsonl", [frame(5, 1), frame(3, 2), "oops\n"])
    app = create_replay_app(RecordSource.open(path), playing=False)
    async with app.run_test(size=(140, 40)) as pilot:
        await pilot.pause()
        assert "not recorded time" in status_text(app)
        assert "1 malformed line(s) skipped" in status_text(app)


def test_offline_modules_import_no_ui_library() -> None:
    code = (
        "import sys\n"
        "for m in ('record', 'recordfile', 'recorded', 'playback', 'diff', 'summary', 'plot'):\n"
        "    __import__('gputaskman.offline.' + m)\n"
        "__import__('gputaskman.cli.replay')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('textual', 'rich')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _mangle(doc: dict, muts: list) -> dict:
    doc = json.loads(json.dumps(doc))
    slots: list = []

    def walk(node) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            slots.append((node, k))
            if isinstance(v, (dict, list)):
                walk(v)

    walk(doc)
    for idx, value in muts:
        parent, key = slots[idx % len(slots)]
        parent[key] = value
    return doc


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.none(), max_size=2),
)


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(0, 100_000), _values), min_size=1, max_size=5))
def test_snapshot_loader_fuzz_only_ever_raises_snapshot_error(muts) -> None:
    from gputaskman.offline.recorded import snapshot_from_json

    base = frame(0, 1, [ms.proc(4242, 3 * GIB), ms.proc(5, None, name=None, bus=None)])
    try:
        snap, system = snapshot_from_json(_mangle(base, muts))
    except SnapshotError:
        return
    report.to_json_dict(snap, system)  # whatever loads can be shown again
    system.render_lines()


def test_models_breakdowns_and_app_models_replay_as_recorded() -> None:
    import dataclasses

    from gputaskman.base.readings import ModelRef, Reading
    from gputaskman.intel.apps import AppModel
    from gputaskman.intel.llm import LlmView, ViewPart
    from gputaskman.offline.recorded import snapshot_from_json

    model = ModelRef(
        "qwen",
        "api",
        True,
        "/m/q.gguf",
        "ollama",
        "confirmed",
        ("api", "mapped"),
        False,
        "llama.cpp",
        "127.0.0.1:8080",
        (),
        None,
    )
    app = AppModel("Handy", "whisper-small", None, "loaded", "whisper-small", None, None)
    view = LlmView(
        "qwen",
        "/m/q.gguf",
        "mapped",
        "single source",
        "?",
        parts=(
            ViewPart("weights", Reading.estimated(GIB, "gguf tensor sizes"), marker="*"),
            ViewPart(
                "kv_cache",
                Reading.runtime(GIB // 4, "llama.cpp log"),
                (Reading.estimated(GIB // 5, "gguf KV formula"),),
            ),
        ),
        reported_total=GIB // 4,
        estimated_total=GIB,
        notes=("recorded",),
    )
    p = dataclasses.replace(ms.proc(7, 2 * GIB), model=model, app_model=app)
    p2 = dataclasses.replace(ms.proc(8, 1 * GIB), breakdown=view)
    doc = frame(0, 4, [p, p2])
    snap, system = snapshot_from_json(doc)
    assert report.to_json_dict(snap, system, None) == doc
    # the same objects as live, so the inspector and the exporter show them as live
    assert snap.processes[0].model == model and snap.processes[1].breakdown == view
    assert snap.processes[0].app_model == app
    assert report.model_cell(snap.processes[0]).startswith("qwen [api✓]")


def test_a_single_saved_snapshot_is_read_back_pretty_or_compact(tmp_path: Path) -> None:
    """Catches the line-by-line reader taking an indented `gputaskman --json > f` for hundreds
    of unparseable lines ("skipped 466 unparseable line(s)") in replay and summary."""
    out = gtm("--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    pretty, compact = tmp_path / "pretty.json", tmp_path / "compact.json"
    pretty.write_text(out.stdout)
    compact.write_text(json.dumps(doc) + "\n")
    assert out.stdout.count("\n") > 20  # indented over many lines, as --json writes it
    for path in (pretty, compact):
        src = RecordSource.open(path)
        assert len(src.frames) == 1 and not src.report.malformed, src.report
        snap, system = src.load(0)
        assert report.to_json_dict(snap, system, doc["selected_gpu"]) == doc
        s = gtm("summary", str(path))
        assert s.returncode == 0 and "1 snapshots in 1 run(s)" in s.stdout, s.stdout + s.stderr
        assert "unparseable" not in s.stdout
    # an indented file that is cut is not one snapshot: read as lines, each reported
    cut = tmp_path / "cut.json"
    cut.write_text(out.stdout[: len(out.stdout) // 2])
    with open(cut, "rb") as f:
        assert not any(e.ok for e in iter_record(f))


def test_a_file_that_is_not_a_record_is_called_so(tmp_path: Path) -> None:
    """Catches random bytes reported as an interrupted recording."""
    junk = tmp_path / "junk.bin"
    junk.write_bytes(bytes(range(256)) * 12)
    s = gtm("summary", str(junk))
    assert "not a gputaskman record file" in s.stdout + s.stderr
    assert "interrupted" not in s.stdout + s.stderr
