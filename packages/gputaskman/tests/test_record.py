"""`gputaskman record`: real subprocesses on this GPU-less machine (backend unavailable,
real system section, a real process holding a real GGUF file mapped), plus in-process
runs over mocked NVML data for the GPU fields. Signals are real signals."""

from __future__ import annotations

import errno
import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gputaskman.backends.nvml import NvmlBackend
from gputaskman.offline import record
from gputaskman.offline.recorded import snapshot_from_json
from gputaskman.offline.recordfile import check_snapshot, iter_record
from gputaskman.render import report
from gputaskman.sampling.collector import SCAN_BUDGET, Collector

HERE = Path(__file__).parent


def _helper(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ms = _helper("mocked_snapshots")
HOLDER = (
    "import mmap, sys, time\n"
    "f = open(sys.argv[1], 'rb')\n"
    "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def gtm(*args: str) -> list[str]:
    return [sys.executable, "-m", "gputaskman.cli", *args]


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


@pytest.fixture
def model_holder(tmp_path: Path):
    """A real process that maps a real GGUF file (so record has a process row)."""
    write_model = _helper("gguf_files").write_model
    model = tmp_path / "tiny.gguf"
    write_model(model, "llama", n_layer=1, n_embd=32, n_head=2, n_head_kv=2, ctx=64)
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(model)], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        yield p, model
    finally:
        p.kill()
        p.wait()


def test_record_subprocess_lines_are_exactly_json_objects(tmp_path: Path, model_holder) -> None:
    holder, model = model_holder
    out = tmp_path / "rec.jsonl"
    res = subprocess.run(
        gtm("record", str(out), "--interval", "0.2", "--count", "3"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "recorded 3 samples" in res.stderr
    raw = lines_of(out)
    assert len(raw) == 3 and all(line.endswith(b"\n") for line in raw)
    one_shot = json.loads(
        subprocess.run(gtm("--json"), capture_output=True, text=True, timeout=60, check=True).stdout
    )
    taken = []
    for line in raw:
        doc = check_snapshot(json.loads(line))
        # compact, one object: the line is exactly what encode_line makes of the object
        assert line == record.encode_line(doc)
        assert report.null_rule_violations(doc) == []
        # the same shape --json prints (nothing added or dropped) ...
        assert set(doc) == set(one_shot)
        assert set(doc["system"]) == set(one_shot["system"])
        # ... and the object to_json_dict makes of the snapshot it describes
        snap, system = snapshot_from_json(doc)
        assert report.to_json_dict(snap, system, doc["selected_gpu"]) == doc
        # unknown stays null with its reason (no GPU here), never 0
        assert doc["available"] is False and doc["attributed_bytes"] is None
        taken.append(doc["taken"])
        rows = [p for p in doc["processes"] if p["pid"] == holder.pid]
        assert rows, "the process holding a GGUF file is recorded"
        assert rows[0]["vram_bytes"]["value"] is None and rows[0]["vram_bytes"]["reason"]
        if rows[0]["scanned"]:
            assert str(model) in rows[0]["model_files"]
    assert taken == sorted(taken) and len(set(taken)) == 3


class Capturing:
    """Wraps a real collector and keeps what each sample returned."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.returned: list = []

    def sample_with_system(self):
        got = self.inner.sample_with_system()
        self.returned.append(got)
        return got

    def close(self) -> None:
        self.inner.close()


def test_nvml_mocked_record_lines_equal_to_json_dict_of_each_sample(tmp_path: Path) -> None:
    nvml_mod = _helper("test_nvml_mocked")
    lib = nvml_mod.MockedNvml([nvml_mod.device(nvml_mod.BUS_A), nvml_mod.device(nvml_mod.BUS_B)])
    src = Capturing(Collector(gpu=1, source=NvmlBackend(lib)))
    out = tmp_path / "gpu.jsonl"
    fd = record.open_record(out)
    try:
        res = record.Recorder(fd, src, selected_gpu=1, interval=0.01, count=3).run()
    finally:
        os.close(fd)
    assert res.samples == 3 and res.stopped_by == "count"
    expected = [record.encode_line(report.to_json_dict(s, sy, 1)) for s, sy in src.returned]
    assert lines_of(out) == expected
    doc = json.loads(lines_of(out)[0])
    # the measured GPU values went through untouched
    assert doc["adapters"][0]["metrics"]["memory_total_bytes"]["value"] == 16 * ms.GIB
    assert doc["selected_gpu"] == 1


def test_record_samples_with_the_tui_scan_budget() -> None:
    c = record.make_collector(None)
    try:
        assert c.scan_budget == SCAN_BUDGET and c.scan_budget is not None
        from gputaskman.tui.app import create_app

        tui = create_app()._factory()
        try:
            assert c.scan_budget == tui.scan_budget
        finally:
            tui.close()
    finally:
        c.close()


class Scripted:
    """A sample source that returns mocked snapshots and can fail or be interrupted."""

    def __init__(self, actions: list) -> None:
        self.actions = list(actions)
        self.calls = 0

    def sample_with_system(self):
        self.calls += 1
        a = self.actions.pop(0) if self.actions else "ok"
        if isinstance(a, BaseException):
            raise a
        return ms.snapshot(ms.T0 + self.calls), None

    def close(self) -> None:
        pass


def run_recorder(path: Path, source, **kw) -> record.RecordResult:
    fd = record.open_record(path)
    try:
        return record.Recorder(fd, source, **kw).run()
    finally:
        os.close(fd)


def test_interrupted_sample_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    src = Scripted(["ok", "ok", KeyboardInterrupt()])
    res = run_recorder(out, src, interval=0.001)
    assert res.stopped_by == "interrupt" and res.samples == 2 and src.calls == 3
    lines = lines_of(out)
    assert len(lines) == 2 and all(json.loads(x)["taken"] for x in lines)


def test_failed_sample_is_counted_and_recording_goes_on(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    src = Scripted(["ok", RuntimeError("probe broke"), RuntimeError("probe broke"), "ok"])
    errors: list[str] = []
    res = run_recorder(out, src, interval=0.001, count=2, on_error=errors.append)
    assert res.samples == 2 and res.failures == 2 and src.calls == 4
    assert errors == ["RuntimeError: probe broke"]  # reported once, not per sample
    assert [json.loads(x)["taken"] for x in lines_of(out)] == [ms.T0 + 1, ms.T0 + 4]


def test_sigint_during_a_write_is_held_until_the_line_is_whole(tmp_path, monkeypatch) -> None:
    out = tmp_path / "r.jsonl"
    fd = record.open_record(out)
    real_write = os.write
    calls = []

    def slow_write(f: int, data: bytes) -> int:
        # the kernel may write less than asked; a signal arrives in the middle
        if not calls:
            os.kill(os.getpid(), signal.SIGINT)
        calls.append(len(data))
        return real_write(f, data[:100])

    line = record.encode_line(ms.doc(ms.snapshot()))
    monkeypatch.setattr(record.os, "write", slow_write)
    try:
        with record.stop_signals(), pytest.raises(KeyboardInterrupt):
            record.write_line(fd, line)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert len(calls) > 2  # it really was written in pieces
    assert out.read_bytes() == line


def test_a_write_failing_midway_is_undone(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "r.jsonl"
    first = record.encode_line(ms.doc(ms.snapshot()))
    ms.write_record(out, [first.decode()])
    fd = record.open_record(out)
    real_write = os.write
    state = {"n": 0}

    def full_disk(f: int, data: bytes) -> int:
        state["n"] += 1
        if state["n"] == 1:
            return real_write(f, data[:50])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(record.os, "write", full_disk)
    try:
        with pytest.raises(record.RecordError, match="No space left"):
            record.write_line(fd, first)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert out.read_bytes() == first  # the half line is gone


def test_duration_and_slow_samples_follow_the_interval_grid(tmp_path: Path) -> None:
    now = [0.0]
    sleeps: list[float] = []

    class Slow(Scripted):
        def sample_with_system(self):
            now[0] += self.durations.pop(0)
            return super().sample_with_system()

    src = Slow([])
    src.durations = [0.1, 2.5, 0.1, 0.1, 0.1, 0.1]

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    res = run_recorder(
        tmp_path / "r.jsonl", src, interval=1.0, duration=6.0, clock=lambda: now[0], sleep=sleep
    )
    # starts at 0, 1 (takes 2.5 s: the tick at 2 and 3 are skipped, not burst), 4, 5; 6 is
    # the end of the duration
    assert res.samples == 4 and res.stopped_by == "duration"
    assert sleeps == pytest.approx([0.9, 0.5, 0.9])


def _wait_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    raise AssertionError(f"record did not write {n} lines in {timeout}s")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_record_stopped_by_signal_keeps_every_sample_whole(tmp_path: Path, sig) -> None:
    out = tmp_path / "r.jsonl"
    p = subprocess.Popen(
        gtm("record", str(out), "--interval", "0.02"), stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_lines(out, 3, p)
        p.send_signal(sig)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, err
    data = out.read_bytes()
    assert data.endswith(b"\n")
    entries = list(iter_record(open(out, "rb")))  # noqa: SIM115
    assert entries and all(e.ok for e in entries)
    assert f"recorded {len(entries)} samples" in err


def test_record_killed_with_sigkill_keeps_every_finished_sample(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    p = subprocess.Popen(gtm("record", str(out), "--interval", "0.01"), stderr=subprocess.DEVNULL)
    try:
        _wait_lines(out, 4, p)
        before = out.read_bytes()
        p.kill()
        p.wait(timeout=30)
    finally:
        p.kill()
    after = out.read_bytes()
    finished = before[: before.rfind(b"\n") + 1]
    assert after.startswith(finished)  # every sample finished before the kill is intact
    entries = list(iter_record(open(out, "rb")))  # noqa: SIM115
    complete = [e for e in entries if not e.incomplete]
    assert len(complete) >= finished.count(b"\n") >= 4
    assert all(e.ok for e in complete)  # every whole line parses
    # at most the last line can be cut by SIGKILL, and readers skip it as incomplete
    assert all(not e.incomplete for e in entries[:-1])

    # a second recorder appends after it without gluing onto a torn line
    res = subprocess.run(gtm("record", str(out), "--count", "1"), capture_output=True, timeout=60)
    assert res.returncode == 0
    again = list(iter_record(open(out, "rb")))  # noqa: SIM115
    assert again[-1].ok and not again[-1].incomplete


def test_append_after_a_torn_line_terminates_it(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    good = record.encode_line(ms.doc(ms.snapshot()))
    out.write_bytes(good + good[:40])  # a recorder killed mid-write
    run_recorder(out, Scripted([]), interval=0.001, count=1)
    entries = list(iter_record(open(out, "rb")))  # noqa: SIM115
    assert [e.ok for e in entries] == [True, False, True]
    assert entries[1].error and not entries[1].incomplete  # reported as malformed
    assert out.read_bytes().startswith(good + good[:40] + b"\n")


def test_record_refuses_to_append_to_a_file_that_is_not_a_record(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\nline two\n")
    res = subprocess.run(
        gtm("record", str(notes), "--count", "1"), capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2
    assert "not a gputaskman record file" in res.stderr
    assert notes.read_text() == "my notes\nline two\n"


def test_record_appends_to_its_own_file(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    run_recorder(out, Scripted([]), interval=0.001, count=2)
    run_recorder(out, Scripted([]), interval=0.001, count=1)
    assert [json.loads(x)["taken"] for x in lines_of(out)] == [ms.T0 + 1, ms.T0 + 2, ms.T0 + 1]


@pytest.mark.parametrize(
    "bad", [["--interval", "0"], ["--interval", "x"], ["--count", "0"], ["--duration", "-1"]]
)
def test_record_rejects_bad_options(tmp_path: Path, bad: list[str]) -> None:
    out = tmp_path / "r.jsonl"
    res = subprocess.run(gtm("record", str(out), *bad), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "error" in res.stderr
    assert not out.exists()


def test_record_keeps_the_selected_gpu(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    res = subprocess.run(
        gtm("--gpu", "1", "record", str(out), "--count", "1"), capture_output=True, timeout=60
    )
    assert res.returncode == 0
    assert json.loads(out.read_text())["selected_gpu"] == 1


def test_record_cannot_open_says_why(tmp_path: Path) -> None:
    res = subprocess.run(
        gtm("record", str(tmp_path / "no" / "dir.jsonl"), "--count", "1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "cannot open" in res.stderr


def test_record_shows_a_live_sample_count_on_a_terminal(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(
            gtm("record", str(out), "--interval", "0.05", "--count", "3"),
            stderr=slave,
            stdout=subprocess.DEVNULL,
        )
        os.close(slave)
        chunks = b""
        while True:
            try:
                got = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not got:
                break
            chunks += got
        p.wait(timeout=60)
    finally:
        os.close(master)
    text = chunks.decode()
    assert p.returncode == 0
    for n in (1, 2, 3):
        assert f"\r\x1b[K{n} samples" in text
    assert "recorded 3 samples" in text


def test_a_stop_during_the_write_still_counts_the_line(tmp_path: Path, monkeypatch) -> None:
    """Catches a stop raised between writing a sample and counting it: the file held 4
    samples and the recorder said "recorded 3" (a CI run under load)."""
    out = tmp_path / "r.jsonl"
    fd = record.open_record(out)
    real_write = os.write

    def signalled_write(f: int, data: bytes) -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the line is being written
        return real_write(f, data)

    rec = record.Recorder(fd, Scripted([]), interval=0.01, count=5)
    monkeypatch.setattr(record.os, "write", signalled_write)
    try:
        with record.stop_signals():
            result = rec.run()
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert result.stopped_by == "interrupt"
    lines = out.read_bytes().splitlines()
    assert result.samples == len(lines) == 1
