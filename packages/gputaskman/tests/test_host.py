"""host.py: /proc parsers (fixtures in the kernel's exact format, fuzz), the real machine's
numbers, a real swap file with an odd name, and CPU-rate history keyed by (pid, create_time)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from gputaskman.base import procfs
from gputaskman.base.readings import Kind, Reason
from gputaskman.render import report_models
from gputaskman.sampling.host import (
    FIRST_SAMPLE,
    HostSampler,
    parse_cpu_line,
    parse_meminfo,
    parse_swaps,
    unescape_swap_name,
)
from hypothesis import given, settings
from hypothesis import strategies as st

# The header and row layout of mm/swapfile.c swap_show(): name padded to 40 columns,
# "partition" or "file\t", then size, used (KiB) and priority separated by tabs.
SWAPS_HEADER = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"


def kernel_swaps_line(escaped_name: str, is_file: bool, size: int, used: int, prio: int) -> str:
    pad = 40 - len(escaped_name) if len(escaped_name) < 40 else 1
    kind = "file\t" if is_file else "partition"
    return f"{escaped_name}{' ' * pad}{kind}\t{size}\t\t{used}\t\t{prio}\n"


def kernel_escape(name: str) -> str:
    """seq_file_path(..., " \\t\\n\\\\") as the kernel applies it to swap file names."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in name)


# --------------------------------------------------------------------------- /proc/swaps


def test_parse_swaps_kernel_format_partition_and_odd_file_names() -> None:
    text = (
        SWAPS_HEADER
        + kernel_swaps_line("/dev/dm-1", False, 1003516, 0, -2)
        + kernel_swaps_line(kernel_escape("/var/swap file\tx\\y"), True, 102396, 512, 5)
        + kernel_swaps_line(
            kernel_escape("/a/very/long/path/to/a/swapfile/beyond/40/cols"), True, 8, 4, -3
        )
    )
    devices, problems = parse_swaps(text)
    assert problems == ()
    assert [d.filename for d in devices] == [
        "/dev/dm-1",
        "/var/swap file\tx\\y",
        "/a/very/long/path/to/a/swapfile/beyond/40/cols",
    ]
    assert [d.type for d in devices] == ["partition", "file", "file"]
    assert devices[0].size_bytes == 1003516 * 1024 and devices[0].used_bytes == 0
    assert devices[1].used_bytes == 512 * 1024 and devices[1].priority == 5
    assert devices[2].priority == -3
    assert not any(d.deleted for d in devices)


def test_parse_swaps_deleted_file_is_flagged_and_name_kept() -> None:
    # d_path appends " (deleted)" before escaping, so the space arrives as \040.
    text = SWAPS_HEADER + kernel_swaps_line("/swap\\040(deleted)", True, 100, 0, -2)
    (dev,), problems = parse_swaps(text)
    assert dev.filename == "/swap" and dev.deleted and problems == ()


@pytest.mark.parametrize("text", ["", SWAPS_HEADER, "\n\n", SWAPS_HEADER + "\n"])
def test_parse_swaps_empty_means_no_devices(text: str) -> None:
    assert parse_swaps(text) == ((), ())


def test_parse_swaps_bad_lines_are_reported_not_guessed() -> None:
    text = SWAPS_HEADER + "/dev/x partition\n" + "/dev/y partition lots 0 -2\n"
    devices, problems = parse_swaps(text)
    assert len(problems) == 2
    (dev,) = devices  # the second line has a name and type, its size is unknown (None)
    assert dev.filename == "/dev/y" and dev.size_bytes is None and dev.used_bytes == 0


def test_unescape_leaves_unknown_escapes_alone() -> None:
    assert unescape_swap_name("a\\040b\\999c\\") == "a b\\999c\\"


_names = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs",),
        blacklist_characters="\x00\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\u2028\u2029\xa0\u1680\u3000",
    ),
    min_size=1,
    max_size=60,
).filter(lambda s: not s.strip().startswith("Filename") and s.strip() != "")


@given(
    name=_names,
    is_file=st.booleans(),
    size=st.integers(0, 2**40),
    used=st.integers(0, 2**40),
    prio=st.integers(-(2**15), 2**15),
)
@settings(max_examples=300)
def test_fuzz_swaps_roundtrip_of_kernel_lines(
    name: str, is_file: bool, size: int, used: int, prio: int
) -> None:
    escaped = kernel_escape("/" + name)
    # Only ASCII whitespace is escaped by the kernel; other Unicode spaces would split the
    # columns in any whitespace-separated reader, so the strategy leaves them out.
    devices, problems = parse_swaps(
        SWAPS_HEADER + kernel_swaps_line(escaped, is_file, size, used, prio)
    )
    (dev,) = devices
    expected = "/" + name
    deleted = expected.endswith(" (deleted)")
    assert dev.filename == (expected[: -len(" (deleted)")] if deleted else expected)
    assert dev.deleted is deleted
    assert (dev.size_bytes, dev.used_bytes, dev.priority) == (size * 1024, used * 1024, prio)
    assert dev.type == ("file" if is_file else "partition") and problems == ()


@given(st.text(max_size=400))
@settings(max_examples=300)
def test_fuzz_parsers_never_raise(text: str) -> None:
    parse_swaps(text)
    parse_meminfo(text)
    parse_cpu_line(text)
    unescape_swap_name(text)
    procfs.parse_stat(text.encode("utf-8", "surrogatepass"))


# --------------------------------------------------------------------------- meminfo, stat


def test_parse_meminfo_units_and_bad_lines() -> None:
    text = "MemTotal:       1000 kB\nHugePages_Total:       4\nOdd: x kB\nWeird: 5 MB\nnoline\n"
    assert parse_meminfo(text) == {"MemTotal": 1024000, "HugePages_Total": 4}


def test_parse_cpu_line_busy_and_total() -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    busy, total = parse_cpu_line("cpu  10 1 5 100 4 2 3 1 7 0\ncpu0 1 1 1 1\n") or (0, 0)
    assert total == 10 + 1 + 5 + 100 + 4 + 2 + 3 + 1  # guest is inside user already
    assert busy == total - 100 - 4
    assert parse_cpu_line("cpu0 1 2 3 4\n") is None


def test_parse_stat_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(["S", "1"] + ["0"] * 9 + ["7", "3"] + ["0"] * 6 + ["4242", "0", "99"])
    parsed = procfs.parse_stat(f"123 (a) b (c) {fields} 0 0\n".encode())
    assert parsed is not None
    assert parsed.name == "a) b (c" and parsed.utime_ticks == 7 and parsed.stime_ticks == 3
    assert parsed.start_ticks == 4242 and parsed.rss_pages == 99


# --------------------------------------------------------------------------- real machine


def test_real_machine_values_are_sane_and_os_reported() -> None:
    sampler = HostSampler()
    first = sampler.sample()
    m = first.memory
    assert m.total_bytes.kind is Kind.MEASURED and m.total_bytes.source == "/proc/meminfo"
    total, avail = m.total_bytes.value, m.available_bytes.value
    assert total is not None and avail is not None and 0 < avail <= total
    assert m.used_bytes.value == total - avail
    psutil_total = psutil.virtual_memory().total
    assert total == psutil_total
    assert first.cpu.logical_cpus.value == os.cpu_count()
    assert all(
        r.value is not None and r.value >= 0
        for r in (first.cpu.load_1, first.cpu.load_5, first.cpu.load_15)
    )
    # A rate needs two samples: the first is unknown with a reason, never 0.
    assert first.cpu.percent.value is None and first.cpu.percent.reason is Reason.UNAVAILABLE
    time.sleep(0.2)
    second = sampler.sample()
    assert second.cpu.percent.value is not None and 0.0 <= second.cpu.percent.value <= 100.0
    # Swap totals come from meminfo; the devices from /proc/swaps must add up to them.
    s = second.swap
    assert s.devices is not None and s.problems == ()
    if s.total_bytes.value is not None:
        assert sum(d.size_bytes or 0 for d in s.devices) == s.total_bytes.value
    assert second.processes_reason is None and os.getpid() in second.processes
    js = report_models.system_json(second)  # the `system` object of --json
    assert js["memory"]["total_bytes"]["value"] == total
    assert all(r["reason"] is None for r in js["cpu"].values() if isinstance(r, dict))


def test_real_process_rss_and_create_time_match_psutil() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        p = psutil.Process(child.pid)
        for _ in range(50):  # wait until the interpreter has settled into its sleep
            if p.status() == psutil.STATUS_SLEEPING and p.memory_info().rss > 4 << 20:
                break
            time.sleep(0.05)
        usage = HostSampler().sample(pids=[child.pid]).processes[child.pid]
        assert usage.create_time == p.create_time()  # bit-identical keys with psutil
        assert usage.rss_bytes == p.memory_info().rss
        assert usage.name == p.name()
        assert usage.cpu_percent is None and usage.cpu_detail == FIRST_SAMPLE
    finally:
        child.kill()
        child.wait()


def test_kernel_threads_have_zero_rss_without_reading_statm() -> None:
    kthreads = [p for p in procfs.list_pids() if _is_kthread(p)]
    if not kthreads:
        pytest.skip("no kernel threads visible in this PID namespace")
    rows = HostSampler().sample(pids=kthreads[:5]).processes
    for pid, row in rows.items():
        statm = Path(f"/proc/{pid}/statm").read_text().split()
        assert statm[1] == "0" and row.rss_bytes == 0 and row.rss_reason is None


def _is_kthread(pid: int) -> bool:
    try:
        return procfs.read_stat(pid).kernel_thread
    except procfs.ProcError:
        return False


def test_vanished_process_is_dropped_and_broken_stat_has_a_reason(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    sampler = HostSampler()
    assert child.pid not in sampler.sample(pids=[child.pid]).processes
    # A fake /proc whose stat is a directory: the read fails with an OS error that is
    # neither "gone" nor "denied", and the row says so instead of showing zeros.
    (tmp_path / "stat").write_text("btime 1000\n")
    (tmp_path / "77" / "stat").mkdir(parents=True)
    rows = HostSampler(proc_root=str(tmp_path)).processes()
    assert set(rows) == {77}
    bad = rows[77]
    assert bad.rss_bytes is None and bad.cpu_percent is None
    assert bad.rss_reason is Reason.QUERY_FAILED and "stat" in (bad.cpu_detail or "")


# --------------------------------------------------------------------------- PID reuse


def test_reused_pid_does_not_inherit_history_constructed_state() -> None:
    pid = os.getpid()
    sampler = HostSampler()
    first = sampler.sample(pids=[pid]).processes[pid]
    assert first.create_time is not None
    ticks_now = sum(psutil.Process(pid).cpu_times()[:2])
    # History that belongs to an *earlier* process with the same PID (other create_time).
    sampler._proc_prev = {(pid, first.create_time - 500.0): (0, time.monotonic() - 1.0)}
    reused = sampler.sample(pids=[pid]).processes[pid]
    assert reused.cpu_percent is None and reused.cpu_detail == FIRST_SAMPLE
    # Control: the same history under this process's own key does give a rate.
    sampler._proc_prev = {(pid, first.create_time): (0, time.monotonic() - 10.0)}
    own = sampler.sample(pids=[pid]).processes[pid]
    assert own.cpu_percent is not None and own.cpu_percent > 0
    assert own.cpu_percent == pytest.approx(ticks_now / 10.0 * 100.0, rel=0.5)


def _spawn_at_pid(pid: int, attempts: int = 200) -> subprocess.Popen[bytes] | None:
    """Start `sleep` so that it gets `pid` (root: /proc/sys/kernel/ns_last_pid)."""
    for _ in range(attempts):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        proc = subprocess.Popen(["sleep", "30"])
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_reused_pid_real_child_gets_no_rate() -> None:
    if os.geteuid() != 0:
        pytest.skip("reusing a PID on purpose needs root (ns_last_pid)")
    sampler = HostSampler()
    # spins until killed: a loaded machine may give it no CPU tick (10 ms) in a short window,
    # so a second sample is taken until one shows its use (each a rate over the last one)
    old = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    new = None
    try:
        sampler.sample()
        deadline = time.monotonic() + 30
        while True:
            time.sleep(0.3)
            rate = sampler.sample().processes[old.pid]
            if rate.cpu_percent or time.monotonic() > deadline:
                break
        assert rate.cpu_percent is not None and rate.cpu_percent > 0  # history works
        old_key = rate.key
        pid = old.pid
        old.kill()
        old.wait()
        new = _spawn_at_pid(pid)
        if new is None:
            pytest.skip("could not get the kernel to hand out the same PID again")
        fresh = sampler.sample().processes[pid]
        assert fresh.key != old_key  # same PID, different process
        assert fresh.cpu_percent is None and fresh.cpu_detail == FIRST_SAMPLE
        assert fresh.name == "sleep"
    finally:
        for p in (old, new):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------- real swap file


@pytest.mark.root
def test_real_swap_file_with_space_in_name(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("mkswap") or not shutil.which("swapon"):
        pytest.skip("needs root and util-linux mkswap/swapon")
    swapfile = tmp_path / f"gtm swap {os.getpid()}"
    swapfile.write_bytes(bytes(1 << 20))  # no holes: swapon refuses sparse files
    swapfile.chmod(0o600)
    subprocess.run(["mkswap", str(swapfile)], check=True, capture_output=True)
    on = subprocess.run(["swapon", "-p", "0", str(swapfile)], capture_output=True, text=True)
    if on.returncode != 0:
        pytest.skip(f"swapon refused here: {on.stderr.strip()}")
    try:
        raw = Path("/proc/swaps").read_text()
        assert "gtm\\040swap" in raw  # the kernel escaped the spaces
        info = HostSampler().sample(pids=[])
        assert info.swap.devices is not None
        mine = [d for d in info.swap.devices if d.filename == str(swapfile)]
        assert len(mine) == 1
        dev = mine[0]
        assert dev.type == "file" and dev.priority == 0 and dev.used_bytes is not None
        assert dev.size_bytes == (1 << 20) - os.sysconf("SC_PAGE_SIZE")  # minus the header
        assert info.swap.total_bytes.value == sum(d.size_bytes or 0 for d in info.swap.devices)
    finally:
        with contextlib.suppress(Exception):
            subprocess.run(["swapoff", str(swapfile)], check=True, capture_output=True)
    assert str(swapfile).replace(" ", "\\040") not in Path("/proc/swaps").read_text()
