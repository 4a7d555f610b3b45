"""WSL: interop detection, the host stream (parser and a real child process), context tracking.

There is no WSL or Windows here. The host-stream samples below are **synthetic replays**:
lines written in the stream format `wslhost.POWERSHELL_SCRIPT` prints, with instance names
shaped like Windows' and made-up values. They are not measurements, and they do not
validate the PowerShell script or the matching on real hardware. `/dev/dxg` holders are
found by the real /proc scan against a real child process holding a temporary file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from gputaskman.backends.win import pdh
from gputaskman.backends.wsl import Interop, WslBackend, dxg_holders, interop_status
from gputaskman.backends.wslhost import (
    MAX_LINE,
    ContextTracker,
    HostStream,
    StreamParser,
    powershell_command,
)
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuSample, GpuSource
from gputaskman.base.readings import Kind, Reason
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner
from hypothesis import given, settings
from hypothesis import strategies as st

MIB = 1024**2
LUID = "luid_0x00000000_0x0000d1a2"
VMWP = 6140


def frame(seq: int, vm_bytes: int | None, others: dict[int, int] | None = None) -> str:
    """One synthetic host sample: vmwp.exe (pid 6140) plus other Windows processes."""
    lines = [f"gtm1\tT\t{seq}\t{1796000000000 + seq * 1000}"]
    procs = {VMWP: vm_bytes} | (others or {})
    for pid, b in procs.items():
        if b is None:
            continue
        inst = f"pid_{pid}_luid_0x00000000_0x0000D1A2_phys_0"
        lines.append(f"gtm1\tC\tL\t{inst}\t{b}")
        lines.append(f"gtm1\tC\tN\t{inst}\t{4 * MIB}")
        lines.append(f"gtm1\tC\tE\t{inst}_eng_0_engtype_3D\t12.5")
    used = sum(b for b in procs.values() if b is not None) + 100 * MIB
    lines.append(f"gtm1\tC\tD\tluid_0x00000000_0x0000D1A2_phys_0\t{used}")
    lines.append(f"gtm1\tP\t{VMWP}\tvmwp")
    for pid in others or {}:
        lines.append(f"gtm1\tP\t{pid}\tdwm")
    lines.append(f"gtm1\tZ\t{seq}")
    return "\n".join(lines) + "\n"


# -- interop detection ---------------------------------------------------------------


def tree(tmp_path, state: str | None, name: str = "WSLInterop"):
    binfmt = tmp_path / "proc/sys/fs/binfmt_misc"
    binfmt.mkdir(parents=True)
    if state is not None:
        (binfmt / name).write_text(f"{state}\ninterpreter /init\nflags: PF\n")
    return str(tmp_path)


def test_interop_off_says_why(tmp_path):
    s = interop_status(tree(tmp_path, None), {}, which=lambda _: None)
    assert not s.ok and "WSLInterop" in (s.reason or "") and "wsl.conf" in (s.reason or "")


def test_interop_disabled_entry_says_so(tmp_path):
    s = interop_status(
        tree(tmp_path, "disabled"),
        {"WSL_INTEROP": "/run/WSL/1_interop"},
        which=lambda _: "/mnt/c/x/powershell.exe",
    )
    assert not s.ok and "disabled" in (s.reason or "")


def test_interop_without_powershell_says_why(tmp_path):
    s = interop_status(
        tree(tmp_path, "enabled"), {"WSL_INTEROP": "/run/WSL/1_interop"}, which=lambda _: None
    )
    assert not s.ok and "powershell.exe not found" in (s.reason or "")


def test_interop_without_wsl_interop_env_says_why(tmp_path):
    s = interop_status(tree(tmp_path, "enabled"), {}, which=lambda _: "/mnt/c/ps.exe")
    assert not s.ok and "WSL_INTEROP" in (s.reason or "")


@pytest.mark.parametrize("name", ["WSLInterop", "WSLInterop-late"])
def test_interop_enabled(tmp_path, name):
    s = interop_status(
        tree(tmp_path, "enabled", name),
        {"WSL_INTEROP": "/run/WSL/9_interop"},
        which=lambda _: "/mnt/c/ps.exe",
    )
    assert s.ok and s.reason is None and s.powershell == "/mnt/c/ps.exe"


def test_powershell_command_encodes_the_script():
    import base64

    cmd = powershell_command(2.0, exe="/mnt/c/ps.exe")
    assert cmd[0] == "/mnt/c/ps.exe" and cmd[-2] == "-EncodedCommand"
    script = base64.b64decode(cmd[-1]).decode("utf-16-le")
    assert "-SampleInterval 2" in script and "Local Usage" in script
    assert "Dedicated Usage" not in script.split("GPU Adapter Memory")[0]  # never per process


# -- the stream parser -------------------------------------------------------------------


def test_parser_completes_frames_and_ignores_noise():
    p = StreamParser()
    data = "Windows PowerShell\r\nCopyright (C) Microsoft\r\n" + frame(1, 4 * 1024 * MIB)
    (f,) = p.feed(data.encode())
    assert f.seq == 1 and f.names[VMWP] == "vmwp"
    assert f.counters[pdh.LOCAL][f"pid_{VMWP}_luid_0x00000000_0x0000D1A2_phys_0"] == 4096 * MIB
    assert p.stats.noise == 2 and p.stats.malformed == 0


def test_parser_drops_an_interrupted_sample():
    p = StreamParser()
    cut = frame(1, 10).rsplit("gtm1\tZ", 1)[0]  # the Z line never came
    assert p.feed((cut + frame(2, 20)).encode())[0].seq == 2
    assert p.stats.incomplete == 1
    assert p.feed(b"gtm1\tT\t3\t0\ngtm1\tC\tL\tpid_1_luid_0x0_0x1_phys_0\t5\n") == []


def test_parser_caps_overlong_lines():
    p = StreamParser()
    assert p.feed(b"gtm1\tC\tL\t" + b"x" * (MAX_LINE + 10)) == []
    assert len(p._buf) == 0 and p.stats.overlong == 1  # nothing buffered without bound
    (f,) = p.feed(b"y" * 100 + b"\n" + frame(4, 7).encode())
    assert f.seq == 4 and p.stats.overlong == 1


def test_parser_failures_become_failed_reads():
    text = frame(1, 5).replace("gtm1\tZ", "gtm1\tX\tE\tCounter not found\ngtm1\tZ")
    (f,) = StreamParser().feed(text.encode())
    reads = f.reads()
    assert reads[pdh.ENGINE].values is None and "Counter not found" in (
        reads[pdh.ENGINE].detail or ""
    )
    assert reads[pdh.LOCAL].values is not None


def test_parser_counts_malformed_lines():
    p = StreamParser()
    bad = (
        "gtm1\tT\t1\t0\ngtm1\tC\tQ\tx\t1\ngtm1\tC\tL\tpid_1_luid_0x0_0x1_phys_0\tnope\ngtm1\tZ\t1\n"
    )
    (f,) = p.feed(bad.encode())
    assert p.stats.malformed == 2 and f.counters == {}


@settings(max_examples=60)
@given(st.lists(st.integers(1, 50), max_size=40))
def test_parser_any_chunking_gives_the_same_frames(cuts):
    data = (frame(1, 100) + "noise\n" + frame(2, 200, {77: 5})).encode()
    p, frames, pos = StreamParser(), [], 0
    for c in cuts:
        frames += p.feed(data[pos : pos + c])
        pos += c
    frames += p.feed(data[pos:])
    assert [f.seq for f in frames] == [1, 2]
    assert frames[1].names == {VMWP: "vmwp", 77: "dwm"}


@given(st.binary(max_size=300))
def test_parser_fuzz_never_raises(data):
    p = StreamParser()
    for f in p.feed(data) + p.feed(b"\n"):
        f.reads()


# -- the host stream driver, with a real child process ---------------------------------


def replay_program(text: str, then: str) -> list[str]:
    code = textwrap.dedent(
        f"""
        import sys, time
        for chunk in {text.encode()!r}.split(b"\\n"):
            sys.stdout.buffer.write(chunk + b"\\n"); sys.stdout.flush(); time.sleep(0.01)
        {then}
        """
    )
    return [sys.executable, "-c", code]


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_host_stream_reads_frames_from_a_real_process_and_reports_its_exit():
    prog = replay_program(
        frame(1, 100) + frame(2, 200),
        'sys.stderr.write("Get-Counter: access denied\\n"); sys.exit(3)',
    )
    hs = HostStream(prog)
    try:
        hs.start()
        assert wait_for(lambda: hs._proc.poll() is not None)
        f, why = hs.latest()
        assert f is not None and f.seq == 2
        assert why is not None and "code 3" in why and "access denied" in why
    finally:
        hs.close()


def test_host_stream_close_ends_the_child_it_started():
    hs = HostStream(replay_program(frame(1, 100), "time.sleep(60)"))
    hs.start()
    try:
        assert wait_for(lambda: hs.latest()[0] is not None)
        f, why = hs.latest(max_age=30)
        assert f is not None and why is None
    finally:
        hs.close()
    assert hs._proc.poll() is not None  # the child is gone, not left running


def test_host_stream_that_cannot_start_says_why():
    hs = HostStream(["/nonexistent/powershell.exe"])
    hs.start()
    f, why = hs.latest()
    assert f is None and "cannot run /nonexistent/powershell.exe" in (why or "")


# -- /dev/dxg holders, with a real process -----------------------------------------------


def test_dxg_holders_finds_a_real_process_holding_the_device(tmp_path):
    dev = tmp_path / "dxg"
    dev.write_bytes(b"")
    child = subprocess.Popen(
        [sys.executable, "-c", f"f = open({str(dev)!r}); import time; time.sleep(30)"]
    )
    try:
        assert wait_for(lambda: child.pid in dxg_holders(device=str(dev))[0])
        holders, _ = dxg_holders(device=str(dev))
        pid, ct = holders[child.pid]
        assert pid == child.pid and ct is not None
        assert os.getpid() not in holders
    finally:
        child.kill()
        child.wait()
    assert child.pid not in dxg_holders(device=str(dev))[0]


# -- context tracking (synthetic replays) --------------------------------------------------

A, B = (100, 1.0), (200, 2.0)


def test_tracker_replay_baseline_then_one_then_two_holders():
    t = ContextTracker()
    assert t.update(300 * MIB, []) == {}  # idle VM: WSLg's own use is the baseline
    r = t.update(4396 * MIB, [A])
    assert r[A].reading.value == 4096 * MIB and r[A].reading.kind is Kind.INFERRED
    assert r[A].unique  # one holder, baseline known: the only explanation
    r = t.update(5420 * MIB, [A, B])  # B opens /dev/dxg; the total rises 1 GiB
    assert r[B].reading.value == 1024 * MIB and not r[B].unique
    assert r[A].reading.value == 4096 * MIB and not r[A].unique
    r = t.update(1324 * MIB, [B])  # A exits; B alone again
    assert set(r) == {B} and r[B].reading.value == 1024 * MIB and r[B].unique


def test_tracker_replay_started_late_gives_an_upper_bound_only():
    t = ContextTracker()
    r = t.update(4396 * MIB, [A])
    assert r[A].reading.value == 4396 * MIB and not r[A].unique
    assert "upper bound" in (r[A].reading.detail or "")


def test_tracker_replay_two_holders_from_the_start_cannot_be_split():
    t = ContextTracker()
    r = t.update(300 * MIB, [])
    r = t.update(5000 * MIB, [A, B])
    for k in (A, B):
        assert r[k].reading.value is None and r[k].reading.reason is Reason.UNAVAILABLE
        assert r[k].reading.kind is Kind.INFERRED


def test_tracker_replay_total_below_inferences_drops_them():
    t = ContextTracker()
    t.update(300 * MIB, [])
    t.update(4396 * MIB, [A])
    t.update(5420 * MIB, [A, B])
    r = t.update(2000 * MIB, [A, B])  # someone freed memory: 5 GiB of shares no longer fit
    assert all(v.reading.value is None for v in r.values())


def test_tracker_unknown_total_is_unknown_never_zero():
    r = ContextTracker().update(None, [A])
    assert r[A].reading.value is None and r[A].reading.reason is Reason.UNAVAILABLE


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, 2**36)),
            st.sets(st.sampled_from([A, B, (300, 3.0)])),
        ),
        max_size=25,
    )
)
def test_tracker_fuzz_inferences_never_exceed_the_vm_total(steps):
    t = ContextTracker()
    for total, holders in steps:
        out = t.update(total, sorted(holders))
        assert set(out) == holders
        values = [i.reading.value for i in out.values() if i.reading.value is not None]
        if total is None:
            assert values == []
        else:
            assert sum(values) <= total
            assert all(v >= 0 for v in values)


# -- the backend, end to end (synthetic replay through a real parser) ----------------------


class ReplayHost:
    """Hands out parsed frames one per sample, as HostStream.latest() would."""

    def __init__(self, text: str) -> None:
        self.frames = StreamParser().feed(text.encode())
        self.started = self.closed = False

    def start(self):
        self.started = True

    def latest(self, max_age=None):
        return (self.frames.pop(0) if len(self.frames) > 1 else self.frames[0]), None

    def close(self):
        self.closed = True


class NoNvml(GpuSource):
    def sample(self):
        from gputaskman.base.readings import Problem

        p = Problem("backend.init", Reason.NO_LIBRARY, "NVML Shared Library Not Found")
        return GpuSample("nvml", problems=(p,), backend_problem=p)

    def close(self):
        pass


def test_wsl_replay_inferred_rows_sit_under_vmwp_and_are_never_summed():
    host = ReplayHost(frame(1, 300 * MIB, {4: 50 * MIB}) + frame(2, 4396 * MIB, {4: 50 * MIB}))
    steps = iter([{}, {A[0]: A}, {A[0]: A}])
    b = WslBackend(
        nvml=NoNvml(),
        host=host,
        interop=Interop(True, None, "/mnt/c/ps.exe"),
        holders=lambda: (next(steps), 0),
    )
    s1 = b.sample()
    assert s1.backend_problem is None and s1.probe.status == "ok"  # host view answered
    s2 = b.sample()
    vm = next(p for p in s2.processes if p.pid == VMWP)
    assert vm.host == "windows" and vm.dedicated.value == 4396 * MIB and vm.name == "vmwp"
    wsl_row = next(p for p in s2.processes if p.pid == A[0] and p.host is None)
    assert wsl_row.parent_pid == VMWP and wsl_row.unique
    assert wsl_row.inferred is not None and wsl_row.inferred.value == 4096 * MIB
    assert wsl_row.dedicated.value is None and wsl_row.dedicated.reason is Reason.NOT_LISTED
    # through the collector: only measured host bytes are summed (vmwp.exe + dwm), once
    c = Collector(source=b, scanner=NullScanner())
    snap = c.sample()  # the replay repeats its last frame
    c.close()
    assert host.closed
    assert snap.attributed_on(LUID) == 4396 * MIB + 50 * MIB
    assert report.null_rule_violations(report.to_json_dict(snap, None)) == []
    assert schema.errors(report.to_json_dict(snap, None)) == []  # the packaged JSON Schema


def test_wsl_interop_off_reduces_what_is_shown_and_says_why():
    b = WslBackend(
        nvml=NoNvml(),
        interop=Interop(False, "WSL interop is off: no WSLInterop"),
        holders=lambda: ({}, 0),
    )
    s = b.sample()
    assert any(p.where == "wsl.interop" and "WSLInterop" in (p.detail or "") for p in s.problems)
    assert s.probe.status == "failed" and s.probe.reason is Reason.NO_LIBRARY


def test_wsl_replay_two_vm_workers_refuse_inference():
    two = frame(1, 300 * MIB, {7000: 10 * MIB}).replace("gtm1\tP\t7000\tdwm", "gtm1\tP\t7000\tvmwp")
    b = WslBackend(
        nvml=NoNvml(),
        host=ReplayHost(two),
        interop=Interop(True, None, "ps"),
        holders=lambda: ({A[0]: A}, 0),
    )
    s = b.sample()
    assert not [p for p in s.processes if p.host is None]
    assert any(
        p.where == "wsl.context" and "several vmwp.exe" in (p.detail or "") for p in s.problems
    )


def test_wsl_dead_host_stream_is_restarted_rarely_with_a_real_process(tmp_path):
    marker = tmp_path / "runs"
    code = textwrap.dedent(
        f"""
        import sys, pathlib
        m = pathlib.Path({str(marker)!r})
        n = int(m.read_text()) + 1 if m.exists() else 1
        m.write_text(str(n))
        sys.stdout.write({frame(1, 300 * MIB)!r})
        sys.stdout.flush()
        sys.exit(1)
        """
    )
    now = [0.0]
    hs = HostStream([sys.executable, "-c", code])
    b = WslBackend(
        nvml=NoNvml(),
        host=hs,
        interop=Interop(True, None, "ps"),
        holders=lambda: ({}, 0),
        clock=lambda: now[0],
    )
    try:
        b.sample()
        assert wait_for(lambda: hs.exited)
        s = b.sample()  # exited: reported, and too soon to restart
        assert any(
            p.where == "wsl.host" and "exited with code 1" in (p.detail or "") for p in s.problems
        )
        assert marker.read_text() == "1"
        now[0] = 31.0
        b.sample()  # due: restarted once
        assert wait_for(lambda: marker.read_text() == "2")
        assert wait_for(lambda: hs.exited)
        b.sample()
        assert marker.read_text() == "2"  # not again before another 30 s
    finally:
        b.close()
