"""What of each process is swapped out, locked or pinned (`sampling.procfacts`, from
``/proc/PID/status``), on real processes: one that swaps inside a memory cgroup (root; with a
swap file of its own when the machine has no swap, removed in ``finally``), one that mlocks,
one that pins io_uring buffers, a zombie, a process gone, a PID that names another process
now. Each number is checked against another kernel counter for the same thing
(``smaps_rollup``, the cgroup's ``memory.stat``) or the exact size the child locked, so a
reading read from the wrong line, scaled wrongly or made up fails. Where swapped bytes are
(pool or swap) is checked against the real ``/proc/swaps`` and a real status socket speaking
duvm's protocol; the rows go through ``--json``, ``--once``, the replay reader, serve's
metrics and the fleet's reading of them."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import Adapter, Kind, ProcGpu, Reading, Reason
from gputaskman.document.reader import read_document
from gputaskman.fleet.promapi import Sample
from gputaskman.fleet.promseries import host_sample
from gputaskman.render import report, text_report
from gputaskman.render.exporter import Cached, snapshot_families
from gputaskman.sampling import duvmpool, host, procfacts
from gputaskman.sampling.collector import Collector
from gputaskman.sampling.host import SwapDevice, SwapInfo
from hypothesis import given
from hypothesis import strategies as st

MIB = 1 << 20
BUS = "00000000:01:00.0"
ROOT = os.geteuid() == 0

# A child that fills `MIB` pages (one byte written per page, so every page is its own), says
# "filled" and waits for a line on stdin.
FILL = """
import sys
n = int(sys.argv[1]) << 20
buf = bytearray(n)
for i in range(0, n, 4096):
    buf[i] = (i >> 12) % 251 + 1
print("filled", flush=True)
sys.stdin.readline()
"""
# A child that mlocks an anonymous mapping of argv[1] MiB.
MLOCK = """
import ctypes, mmap, sys
n = int(sys.argv[1]) << 20
m = mmap.mmap(-1, n)
libc = ctypes.CDLL(None, use_errno=True)
addr = ctypes.c_void_p.from_buffer(m)
if libc.mlock(ctypes.c_void_p(ctypes.addressof(addr)), ctypes.c_size_t(n)) != 0:
    print("mlock failed", ctypes.get_errno(), flush=True)
else:
    print("locked", flush=True)
sys.stdin.readline()
"""
# A child that registers an anonymous mapping of argv[1] MiB as io_uring fixed buffers (the
# kernel pins its pages: VmPin); io_uring_setup / _register are 425 / 427 on every arch.
PIN = """
import ctypes, mmap, sys
n = int(sys.argv[1]) << 20
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 4, params)
if fd < 0:
    print("no io_uring", ctypes.get_errno(), flush=True)
    sys.exit(0)
m = mmap.mmap(-1, n)
m[0:1] = b"x"
class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
iov = Iovec(base, n)
if libc.syscall(427, fd, 0, ctypes.byref(iov), 1) != 0:
    print("register failed", ctypes.get_errno(), flush=True)
else:
    print("pinned", flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def child(code: str, *args: str, preexec=None) -> Iterator[tuple[subprocess.Popen, str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline().strip()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def start_time(pid: int) -> float:
    from gputaskman.base import procfs

    st = procfs.read_stat(pid)
    btime = procfs.boot_time()
    assert btime is not None
    return procfs.create_time(st.start_ticks, btime)


def row(pid: int, create_time: float | None = None) -> ProcGpu:
    ct = start_time(pid) if create_time is None else create_time
    return ProcGpu(pid, ct, "child", BUS, ("compute",), Reading.measured(MIB, "nvml:mock"))


def facts_of(pid: int, create_time: float | None = None, swap=None, pool=None) -> ProcGpu:
    (got,) = procfacts.RowFacts().annotate([row(pid, create_time)], swap, pool)
    return got


def kib_line(pid: int, name: str, key: str) -> int:
    """`key` (kB) of /proc/PID/`name` in bytes."""
    for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/{pid}/{name}")


# ---------------------------------------------------------------------------- the parser


def test_parse_status_reads_the_three_lines_in_bytes_and_the_effective_uid():
    text = (
        b"Name:\tx\nUid:\t1000\t1001\t1000\t1000\nVmLck:\t       8 kB\nVmPin:\t       0 kB\n"
        b"VmSwap:\t   12345 kB\nVmRSS:\t 99 kB\n"
    )
    assert procfacts.parse_status(text) == (
        {"locked": 8192, "pinned": 0, "swapped": 12345 * 1024},
        1001,
    )


@given(st.binary(max_size=400))
def test_parse_status_never_fails_and_never_reads_a_line_that_is_not_kb(data):
    fields, uid = procfacts.parse_status(data)
    for name, value in fields.items():
        assert name in procfacts.STATUS_FIELDS.values()
        assert value >= 0 and value % 1024 == 0
    assert uid is None or uid >= 0


@given(st.integers(0, 2**40), st.sampled_from(["kB", "MB", "pages", ""]))
def test_a_line_in_another_unit_is_unknown_never_a_guess(n, unit):
    fields, _ = procfacts.parse_status(f"VmSwap:\t{n} {unit}\n".encode())
    assert fields == ({"swapped": n * 1024} if unit == "kB" else {})


# ------------------------------------------------------------------------ where swapped bytes are


def _swap(*names: str) -> SwapInfo:
    r = Reading.measured(0, "/proc/meminfo")
    devs = tuple(SwapDevice(n, "partition", MIB, 0, -2) for n in names)
    return SwapInfo(r, r, r, devs)


def _pool(device: str | None) -> duvmpool.PoolInfo:
    answer = {"pid": 1, "size_bytes": MIB, "replicas": 2, "store": {"peers": []}, "nbd": {}}
    if device is not None:
        answer["swap_device"] = device
    return duvmpool.PoolInfo((duvmpool.parse_status(answer, "/run/duvm/nbd.sock.ctl"),))


@pytest.mark.parametrize(
    "swap, pool, holder, words",
    [
        (_swap("/dev/nbd0"), _pool("/dev/nbd0"), "pool", "is duvm's"),
        (_swap("/dev/nbd0", "/swapfile"), _pool("/dev/nbd0"), "swap", "2 active swap devices"),
        (_swap("/swapfile"), _pool("/dev/nbd0"), "swap", "not the one duvm's daemon names"),
        (_swap("/dev/nbd0"), _pool(None), "swap", "does not name its swap device"),
        (_swap("/dev/nbd0"), None, "swap", "no duvm daemon answered"),
        (SwapInfo(*[Reading.missing(Reason.UNAVAILABLE, "x")] * 3, None), None, "swap", "not read"),
    ],
    ids=["only-duvm", "two-devices", "another-device", "unnamed", "no-duvm", "unread"],
)
def test_swapped_bytes_are_the_pools_only_when_duvms_device_is_the_only_swap(
    swap, pool, holder, words
):
    """Catches a label guessed per device: with a second active device, or a device duvm
    does not name as its own, swapped bytes are swap, never the pool."""
    got, why = procfacts.swap_holder(swap, pool)
    assert (got, words in why) == (holder, True), why


# ---------------------------------------------------------------------------- real processes


def test_mlocked_memory_of_a_child_is_its_locked_bytes_and_goes_through_every_output():
    """Catches VmLck read from the wrong line or scaled wrongly (the child locks exactly
    4 MiB), a measured zero shown as unknown (pinned), and the row's memory lost on its way
    through --json, --once, the replay reader, serve's metrics and the fleet's reading of
    them."""
    with child(MLOCK, "4") as (proc, said):
        if said != "locked":
            pytest.skip(f"mlock refused here ({said}): RLIMIT_MEMLOCK too small")
        got = facts_of(proc.pid)
        m = got.memory
        assert m is not None
        assert m.locked == Reading.measured(4 * MIB, f"/proc/{proc.pid}/status (VmLck)")
        assert m.pinned.value == 0 and m.pinned.kind is Kind.MEASURED
        assert m.swapped.value == kib_line(proc.pid, "smaps_rollup", "Swap")
        assert got.owner is not None and got.owner.cgroup is not None

        class Nvml(GpuSource):  # NVML mocked (no GPU here): lists the child with 1 MiB
            def sample(self) -> GpuSample:
                a = Adapter(0, "nvidia", "NVIDIA Mock GPU", "GPU-mock", BUS, "nvml")
                p = GpuProcess(proc.pid, BUS, ("compute",), Reading.measured(MIB, "nvml:mock"))
                return GpuSample("nvml", adapters=(a,), processes=(p,), driver_version="mock")

            def close(self) -> None:
                pass

        c = Collector(scan_budget=None, source=Nvml(), models=None)
        try:
            snap, system = c.sample_with_system()
        finally:
            c.close()
    doc = json.loads(json.dumps(report.to_json_dict(snap, system)))
    assert report.null_rule_violations(doc) == []
    (r,) = [p for p in doc["processes"] if p["pid"] == proc.pid]
    assert r["locked_bytes"]["value"] == 4 * MIB and r["pinned_bytes"]["value"] == 0
    assert r["swapped_to"] in ("pool", "swap")
    back = read_document(json.dumps(doc).encode())
    (again,) = [p.proc for p in back.processes if p.proc.pid == proc.pid]
    (live,) = [p for p in snap.processes if p.pid == proc.pid]
    assert again.memory == live.memory
    text = text_report.render_text(snap, system)
    assert f"PID {proc.pid} " in text.split("HOST MEMORY", 1)[1]
    assert "locked 4.0 MiB" in text
    labels = {"instance": "h:1", "job": "gputaskman"}
    series = [
        Sample({**s.labels, "__name__": s.name, **labels}, (0.0, float(s.value)))
        for fam in snapshot_families(Cached(snap, system, snap.taken, 0.0))
        for s in fam.samples
    ]
    locked = [s for s in series if s.metric["__name__"] == "gputaskman_process_locked_bytes"]
    assert [(s.metric["pid"], s.value[1]) for s in locked] == [(str(proc.pid), 4 * MIB)]
    (fleet_row,) = [p for p in host_sample(series, note="t")[0].processes if p.pid == proc.pid]
    assert fleet_row.memory is not None
    assert fleet_row.memory.locked.value == 4 * MIB and fleet_row.memory.pinned.value == 0
    assert fleet_row.memory.swapped_to == live.memory.swapped_to


def test_io_uring_buffers_of_a_child_are_its_pinned_bytes():
    """Catches VmPin read from the wrong line: the kernel pins the 2 MiB the child registers
    as io_uring fixed buffers, and counts them nowhere else in status."""
    with child(PIN, "2") as (proc, said):
        if said != "pinned":
            pytest.skip(f"io_uring buffers cannot be registered here ({said})")
        m = facts_of(proc.pid).memory
        assert m is not None
        assert m.pinned == Reading.measured(2 * MIB, f"/proc/{proc.pid}/status (VmPin)")
        assert m.locked.value == 0


def test_a_zombie_has_no_memory_lines_not_supported_never_zero():
    """Catches an absent line read as 0: a zombie's status has no Vm lines."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while "Z" not in Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        m = facts_of(proc.pid).memory
        assert m is not None
        for r in (m.swapped, m.locked, m.pinned):
            assert r.value is None and r.reason is Reason.NOT_SUPPORTED, r
            assert "not in /proc" in (r.detail or "")
        assert m.swapped_to is None
    finally:
        proc.wait(30)


def test_a_process_gone_or_a_reused_pid_is_process_gone_never_another_processes_numbers():
    """Catches numbers of the wrong process: a PID whose start time differs from the row's
    is another process now (the row's is gone), and a PID that exited is gone."""
    with child(FILL, "1") as (proc, said):
        assert said == "filled"
        ct = start_time(proc.pid)
        other = facts_of(proc.pid, create_time=ct - 100)
    assert other.memory is not None and other.owner is not None
    assert other.memory.swapped.reason is Reason.PROCESS_GONE
    assert "another process" in (other.memory.swapped.detail or "")
    assert other.owner.cgroup is None and other.owner.reason is Reason.PROCESS_GONE
    gone = facts_of(proc.pid, create_time=ct)
    assert gone.memory is not None and gone.memory.locked.reason is Reason.PROCESS_GONE
    doc = report.process_json(gone, report.proc_host_lookup(None), None)
    assert doc["swapped_bytes"]["value"] is None and doc["swapped_to"] is None


def test_a_row_of_another_os_is_left_unread():
    r = ProcGpu(4, None, "System", None, (), Reading.measured(0, "pdh"), host="windows")
    (got,) = procfacts.RowFacts().annotate([r], None, None)
    assert got.memory is None and got.owner is None


# ---------------------------------------------------------------------------- swapping, root


def _active_swaps() -> list[str]:
    devices, _ = host.parse_swaps(Path("/proc/swaps").read_text())
    return [d.filename for d in devices]


@contextlib.contextmanager
def some_swap(tmp: Path) -> Iterator[str]:
    """An active swap device: the machine's own when it has one, else a 256 MiB swap file of
    this test's (priority -2, below any other), swapped off again in ``finally``."""
    active = _active_swaps()
    if active:
        yield active[0]
        return
    tools = {t: shutil.which(t) for t in ("mkswap", "swapon", "swapoff")}
    if None in tools.values():
        pytest.skip(f"no swap and no tools to make one: {tools}")
    path = tmp / "gtm-test.swap"
    with open(path, "wb") as f:
        chunk = bytes(MIB)
        for _ in range(256):
            f.write(chunk)
    path.chmod(0o600)
    try:
        subprocess.run([tools["mkswap"], str(path)], check=True, capture_output=True, timeout=60)
        on = subprocess.run(
            [tools["swapon"], "-p", "-2", str(path)], capture_output=True, text=True, timeout=60
        )
        if on.returncode != 0:
            pytest.skip(f"swapon refused a swap file here: {on.stderr.strip()}")
        yield str(path)
    finally:
        deadline = time.monotonic() + 120
        while str(path) in _active_swaps():
            off = subprocess.run(
                [tools["swapoff"], str(path)], capture_output=True, text=True, timeout=120
            )
            if off.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        path.unlink(missing_ok=True)


class StatusSocket:
    """A Unix socket answering ``{"cmd": "status"}`` as duvm's daemon does, naming
    `device` as the device it serves as swap."""

    def __init__(self, path: Path, device: str) -> None:
        self.path = path
        self.answer = json.dumps(
            {"pid": os.getpid(), "size_bytes": 64 * MIB, "replicas": 1, "swap_device": device}
            | {"store": {"peers": [], "replicas": 1, "pages_written": 0}, "nbd": {}}
        ).encode()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(self.answer + b"\n")

    def close(self) -> None:
        self.sock.close()


@pytest.mark.skipif(not ROOT, reason="needs root (a memory cgroup, swapon)")
def test_a_process_that_swaps_inside_a_memory_cgroup_shows_its_swapped_bytes(tmp_path):
    """Catches VmSwap read wrongly (the kernel's smaps_rollup count of the same swap entries
    must agree to the byte, and it is whole pages), a swapped process shown with nothing
    swapped, and the pool label given to swap duvm does not name (a real status socket
    speaking duvm's protocol names the device, or another)."""
    cgroup = pytest.importorskip("duvm.base.cgroup", reason="duvm's cgroup helper")
    try:
        cg = cgroup.MemoryCgroup(32 * MIB, prefix="gtm-swap").create()
    except cgroup.CgroupError as e:
        pytest.skip(f"no memory cgroup: {e}")
    try:
        with (
            some_swap(tmp_path) as device,
            child(FILL, "96", preexec=cgroup.joiner(cg.path)) as (
                proc,
                said,
            ),
        ):
            assert said == "filled", said
            # idle now: smaps_rollup counts the same swap entries as VmSwap, to the byte
            swapped = m = None
            for _ in range(20):
                before = kib_line(proc.pid, "smaps_rollup", "Swap")
                m = facts_of(proc.pid).memory
                if before == kib_line(proc.pid, "smaps_rollup", "Swap"):
                    swapped = before
                    break
                time.sleep(0.1)
            assert m is not None and swapped is not None
            assert m.swapped.value == swapped and swapped >= 32 * MIB
            assert swapped % 4096 == 0 and m.swapped.kind is Kind.MEASURED
            # and the cgroup's own counts: its swap, plus the swapped pages still in the swap
            # cache (VmSwap counts those, the cgroup counts them as cached), a batch of slack
            stat = cg.memory_stat()
            if "swap" in stat:
                slack = 64 * 4096
                low, high = stat["swap"] - slack, stat["swap"] + stat.get("swapcached", 0) + slack
                assert low <= swapped <= high, (swapped, stat)
            # where the bytes are: this machine's real swap, and a daemon naming a device
            real = host.HostSampler(duvm=False).sample([proc.pid]).swap
            sock = StatusSocket(tmp_path / "nbd.sock.ctl", device)
            wrong = StatusSocket(tmp_path / "other.ctl", "/dev/nbd15")
            try:
                mine = duvmpool.sample([str(sock.path)])
                theirs = duvmpool.sample([str(wrong.path)])
            finally:
                sock.close()
                wrong.close()
            assert mine.daemons[0].swap_device == device
            only = len(real.devices or ()) == 1
            pool = facts_of(proc.pid, swap=real, pool=mine).memory
            assert pool is not None
            assert pool.swapped_to == ("pool" if only else "swap"), pool.swapped.detail
            other = facts_of(proc.pid, swap=real, pool=theirs).memory
            assert other is not None and other.swapped_to == "swap"
            doc = report.process_json(
                facts_of(proc.pid, swap=real, pool=mine), report.proc_host_lookup(None), None
            )
            assert doc["swapped_to"] == pool.swapped_to
            assert doc["swapped_bytes"]["value"] >= 32 * MIB
    finally:
        cg.remove()
