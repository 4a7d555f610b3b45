"""The TUI's filter (`/`) and signal (`k`) keys, with pilot tests.

The signal tests signal real processes this test starts (`sleep`), never anything else; the
rows naming them are the demo snapshot's (synthetic GPU numbers) with the child's PID and its
real start time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from gputaskman.base.readings import ProcGpu, Snapshot
from gputaskman.fixtures.demo import DemoSystem, demo_snapshot
from gputaskman.offline.playback import RecordSource
from gputaskman.offline.record import encode_line
from gputaskman.render import report
from gputaskman.tui import signalling
from gputaskman.tui.app import GtmApp, create_app
from gputaskman.tui.replay_app import create_replay_app
from gputaskman.tui.screens.help import HelpScreen, help_text
from gputaskman.tui.screens.signal import SignalScreen
from gputaskman.tui.widgets.process_table import ProcessTable
from tui_support import Fixed, settle


def pids(app: GtmApp) -> list[int]:
    return [p.pid for p in app.query_one(ProcessTable).rows_shown.values()]


def status(app: GtmApp) -> str:
    return str(app.query_one("#status").render())


# ------------------------------------------------------------------------ filter


async def test_the_filter_narrows_live_enter_keeps_it_and_esc_clears_it():
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), interval=60.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        assert pids(app) == [4242, 5151, 777, 3131]
        await pilot.press("slash")
        assert app.focused is app.filter_box
        await pilot.press(*"LLAMA")  # any case
        assert pids(app) == [4242, 3131]  # narrowed with each key, before enter
        assert "filter 'LLAMA': 2 shown" in status(app)
        await pilot.press("enter")
        assert app.filter_box.has_class("-hidden") and pids(app) == [4242, 3131]
        assert isinstance(app.focused, ProcessTable)
        await pilot.press("escape")
        assert pids(app) == [4242, 5151, 777, 3131] and "filter" not in status(app)


@pytest.mark.parametrize(
    ("text", "want"),
    [("qwen", [4242]), ("5151", [5151]), ("pytorch", [5151]), ("compositor", [777])],
)
async def test_the_filter_matches_pid_model_runtime_and_category(text, want):
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), interval=60.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("slash", *text, "enter")
        assert pids(app) == want


async def test_the_filter_finds_a_process_by_its_command_line():
    """Catches a filter that reads only the name: ``/vllm`` did not find ``python -m
    vllm.entrypoints...`` (its name is python3); the help says the filter reads it."""
    snap = demo_snapshot()
    procs = list(snap.processes)
    i = next(i for i, p in enumerate(procs) if p.pid == 5151)
    cmd = ("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/q.gguf")
    procs[i] = dataclasses.replace(
        procs[i], detail=dataclasses.replace(procs[i].detail, cmdline=cmd)
    )
    snap = dataclasses.replace(snap, processes=tuple(procs))
    app = create_app(collector_factory=lambda: Fixed(snap), interval=60.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("slash", *"vllm")
        assert pids(app) == [5151] and "filter 'vllm': 1 shown" in status(app)
        table = app.query_one(ProcessTable)
        assert table.render_line(1).text.split()[:2] == ["5151", "python3"]  # drawn
        await pilot.press("escape", "question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "  /              filter rows (name, pid, command line," in help_text(
            list(GtmApp.BINDINGS)
        )


# ------------------------------------------------------------------------ signal


@pytest.fixture
def child():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def with_row(pid: int, create_time: float | None) -> Snapshot:
    snap = demo_snapshot()
    row = dataclasses.replace(snap.processes[0], pid=pid, create_time=create_time, name="sleep")
    return dataclasses.replace(snap, processes=(row,))


def wait_exit(proc: subprocess.Popen, timeout: float = 5.0) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


async def test_k_confirms_then_sends_term_by_default(child):
    app = create_app(
        collector_factory=lambda: Fixed(
            with_row(child.pid, psutil.Process(child.pid).create_time())
        ),
        interval=60.0,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("k")
        await pilot.pause()
        assert isinstance(app.screen, SignalScreen)
        assert child.poll() is None  # nothing is sent before the confirmation
        await pilot.press("enter")
        await pilot.pause()
    assert wait_exit(child) == -15  # SIGTERM


async def test_k_then_kill_sends_sigkill_and_esc_sends_nothing(child):
    app = create_app(
        collector_factory=lambda: Fixed(
            with_row(child.pid, psutil.Process(child.pid).create_time())
        ),
        interval=60.0,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("k", "escape")
        await pilot.pause()
        assert not isinstance(app.screen, SignalScreen) and child.poll() is None
        await pilot.press("k", "down", "down", "enter")
        await pilot.pause()
    assert wait_exit(child) == -9


def test_a_reused_pid_is_never_signalled(child):
    """Catches signalling by PID alone: the row's process exited and its PID now names
    another process, which must not be hit."""
    started = psutil.Process(child.pid).create_time()
    row = with_row(child.pid, started + 1.0).processes[0]
    result = signalling.send(row, "KILL")
    assert not result.sent and "another process now" in result.message
    assert child.poll() is None
    unknown = signalling.send(dataclasses.replace(row, create_time=None), "KILL")
    assert not unknown.sent and "start time is unknown" in unknown.message
    gone = signalling.send(dataclasses.replace(row, pid=2**22 + 12345), "TERM")
    assert not gone.sent and "has exited" in gone.message
    assert child.poll() is None


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv"
)
def test_a_signal_the_os_refuses_says_it_is_not_permitted(child):
    """As user nobody, signalling this root-owned child is refused with the reason, and the
    child lives on."""
    row = with_row(child.pid, psutil.Process(child.pid).create_time()).processes[0]
    code = (
        "import sys, json, dataclasses\n"
        "from gputaskman.tui import signalling\n"
        "from gputaskman.fixtures.demo import demo_snapshot\n"
        "row = dataclasses.replace(demo_snapshot().processes[0], pid=int(sys.argv[1]),\n"
        "    create_time=float(sys.argv[2]), name='sleep')\n"
        "r = signalling.send(row, 'TERM')\n"
        "print(json.dumps([r.sent, r.message]))\n"
    )
    out = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            code,
            str(row.pid),
            repr(row.create_time),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    if out.returncode != 0 and "Permission denied" in out.stderr:
        pytest.skip(f"user nobody cannot run this interpreter: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr
    assert "not permitted" in out.stdout and "false" in out.stdout
    assert child.poll() is None


async def test_readonly_removes_the_signal_key(child):
    app = create_app(
        collector_factory=lambda: Fixed(
            with_row(child.pid, psutil.Process(child.pid).create_time())
        ),
        interval=60.0,
        readonly=True,
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("k")
        await pilot.pause()
        assert not isinstance(app.screen, SignalScreen)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        assert "signal the highlighted process" not in help_text(app.screen._key_list)
    assert child.poll() is None


async def test_replay_never_signals(child, tmp_path: Path):
    """A recording's PIDs are not this machine's processes: in replay `k` does nothing, even
    when a recorded row's PID and start time match a live process."""
    snap = with_row(child.pid, psutil.Process(child.pid).create_time())
    path = tmp_path / "run.jsonl"
    path.write_bytes(encode_line(report.to_json_dict(snap, DemoSystem())))
    app = create_replay_app(RecordSource.open(path), playing=False)
    async with app.run_test(size=(120, 40)) as pilot:
        for _ in range(100):
            await pilot.pause(0.01)
            if app.samples:
                break
        assert pids(app) == [child.pid]
        await pilot.press("k")
        await pilot.pause()
        assert not isinstance(app.screen, SignalScreen)
    time.sleep(0.1)
    assert child.poll() is None


def test_the_signal_choices_are_term_first():
    assert [name for name, _ in signalling.CHOICES] == ["TERM", "INT", "KILL"]
    assert isinstance(demo_snapshot().processes[0], ProcGpu)


def test_the_cli_readonly_flag_reaches_the_app(tmp_path: Path, monkeypatch) -> None:
    """`gputaskman --readonly` builds the TUI read-only (the flag is not parsed and dropped):
    `_tui` runs a real app that has no signal key, and without the flag one that has it."""
    from gputaskman import cli

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))  # a settings file of the test's own
    parse = cli.build_parser().parse_args
    ran: list[GtmApp] = []
    assert cli._tui(parse(["--readonly"]), run=ran.append) == 0
    assert cli._tui(parse([]), run=ran.append) == 0
    readonly, plain = ran
    assert readonly.settings_path is not None and readonly.settings_path.is_relative_to(tmp_path)
    assert isinstance(readonly, GtmApp) and readonly.readonly is True
    assert readonly.check_action("signal", ()) is False  # k does not exist
    assert isinstance(plain, GtmApp) and plain.readonly is False
    assert plain.check_action("signal", ()) is True


# ---------------------------------------------------------------------- settings


async def test_sort_theme_and_interval_persist_across_sessions(tmp_path: Path):
    from gputaskman.tui import settings as settings_mod

    path = tmp_path / "cfg" / "tui.json"
    app = create_app(
        collector_factory=lambda: Fixed(demo_snapshot()), interval=2.5, settings_path=path
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("s", "r")  # sort by PAGED-less next column (RAM), ascending
        app.theme = "nord"
        await pilot.pause()
    saved, problem = settings_mod.load(path)
    assert problem is None
    assert (saved.sort, saved.descending, saved.interval, saved.theme) == (
        "RAM",
        False,
        2.5,
        "nord",
    )
    again = create_app(
        collector_factory=lambda: Fixed(demo_snapshot()), interval=None, settings_path=path
    )
    async with again.run_test(size=(120, 40)) as pilot:
        await settle(pilot, again)
        table = again.query_one(ProcessTable)
        assert (table.sort_column, table.descending) == ("RAM", False)
        assert again.theme == "nord" and again.interval == 2.5
        assert "RAM ▲" in table.labels


async def test_hidden_columns_from_the_settings_file_are_left_out(tmp_path: Path):
    path = tmp_path / "tui.json"
    path.write_text('{"hidden_columns": ["GPU", "CATEGORY"]}')
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), settings_path=path)
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(pilot, app)
        shown = app.query_one(ProcessTable).columns_shown
        assert "GPU" not in shown and "CATEGORY" not in shown and "RUNTIMES" in shown


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "is not JSON"),
        ('["a list"]', "not a JSON object"),
        ('{"sort": "BOGUS", "interval": -1, "hidden_columns": ["PID"]}', "sort 'BOGUS'"),
        (b"\xff\xfe garbage", "not JSON"),
    ],
)
async def test_a_bad_settings_file_is_reported_and_never_stops_the_tui(
    tmp_path: Path, content, words
):
    """Catches a settings file that crashes the TUI at start, or a bad value that is used
    anyway (sort by a column that does not exist, a negative interval, PID hidden)."""
    path = tmp_path / "tui.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    before = path.read_bytes()
    app = create_app(
        collector_factory=lambda: Fixed(demo_snapshot()), interval=None, settings_path=path
    )
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        assert app.settings_problem is not None and words in app.settings_problem
        table = app.query_one(ProcessTable)
        assert table.sort_column == "VRAM" and app.interval == 1.0 and "PID" in table.columns_shown
    assert path.read_bytes() == before  # nothing was changed, so nothing was written


async def test_settings_that_cannot_be_saved_are_reported_once(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "tui.json"  # its folder is a file: every save fails
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), settings_path=path)
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(pilot, app)
        await pilot.press("s", "s")
        assert app.settings_problem is not None and "not saved" in app.settings_problem
        assert app.query_one(ProcessTable).sort_column == "CPU%"  # the keys still work


# ------------------------------------------------------------------ tree and identity


def test_tree_order_puts_children_under_parents_and_survives_a_cycle():
    from gputaskman.base.readings import ProcDetail
    from gputaskman.tui.widgets.process_table import row_key, tree_order

    base = demo_snapshot().processes[0]

    def row(pid: int, ppid: int | None) -> ProcGpu:
        return dataclasses.replace(base, pid=pid, detail=ProcDetail(ppid=ppid))

    rows = [row(1, None), row(5, 9), row(2, 1), row(3, 1), row(4, 2), row(9, 5)]
    ordered, marks = tree_order(rows)
    assert [p.pid for p in ordered] == [1, 2, 4, 3, 5, 9]
    assert [marks[row_key(p)] for p in ordered] == ["", "├ ", "│ └ ", "└ ", "", ""]
    # 5 and 9 are each other's parents: both still shown, once each
    assert sorted(p.pid for p in ordered) == [1, 2, 3, 4, 5, 9]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "n/a"), (-3, "n/a"), (5, "0:05"), (3600, "1:00:00"), (90061, "1-01:01:01")],
)
def test_elapsed_time_reads_like_ps(seconds, text):
    from gputaskman.tui.widgets.process_table import elapsed

    assert elapsed(seconds) == text


async def test_t_shows_processes_under_their_parent_and_user_time_command_columns():
    app = create_app(collector_factory=lambda: Fixed(demo_snapshot()), interval=60.0)
    async with app.run_test(size=(260, 50)) as pilot:  # room for every column, inspector shut
        await settle(pilot, app)
        await pilot.press("i")
        await pilot.pause()
        table = app.query_one(ProcessTable)
        assert {"USER", "TIME", "COMMAND"} <= set(table.columns_shown)
        cols = table.columns_shown
        row = table.get_row("4242@00000000:01:00.0")
        assert str(row[cols.index("USER")]) == "ml" and str(row[cols.index("TIME")]) == "1:00:00"
        assert str(row[cols.index("COMMAND")]).startswith("llama-server -m /models/qwen")
        command = app.query_one(ProcessTable).rows_shown["4242@00000000:01:00.0"].detail.cmdline
        assert command is not None and "***" in command  # the secret redacted, as scanned
        assert pids(app) == [4242, 5151, 777, 3131]
        await pilot.press("t")
        assert pids(app) == [4242, 5151, 3131, 777]  # llama-cli under the script that ran it
        assert str(table.get_row("3131@-")[cols.index("NAME")]) == "└ llama-cli"
        assert "tree" in status(app)
        await pilot.press("t")
        assert pids(app) == [4242, 5151, 777, 3131]


async def test_q_quits_and_closes_the_collector():
    closed: list[bool] = []

    class Closing(Fixed):
        def close(self) -> None:
            closed.append(True)

    app = create_app(collector_factory=lambda: Closing(demo_snapshot()), interval=60.0)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, app)
        await pilot.press("q")
        await pilot.pause()
    assert closed == [True] and app.return_code == 0
