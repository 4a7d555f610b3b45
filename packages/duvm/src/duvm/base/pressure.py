"""What a process on the swap path does so that memory pressure cannot stop it.

Theory of operation
-------------------
The duvm daemon serves the swap device: under memory pressure the kernel frees RAM by writing
pages to it, and every such write waits for the daemon. Anything the daemon itself must wait
for that can only be freed by swapping is a deadlock: the node hangs (then, with the kernel's
nbd driver, requests time out, swap I/O fails and the OOM killer runs out of victims). The
supervisor that restarts a crashed daemon, and the ioctl holder of the kernel nbd fallback,
are on the same path. Each protection below closes one way into that deadlock (measured in a
QEMU guest, docs/ARCHITECTURE.md "Staying alive under memory pressure"):

``lock_in_memory``
    mlockall: no page the process has touched is ever swapped out, so it never waits for a
    swap-in that only it could serve. (MCL_ONFAULT where the kernel has it: the interpreter's
    untouched mappings stay unlocked, which keeps small nodes' locked memory down.) Pages that
    went out before the call (a process started on a node already swapping) are touched back
    in and locked with the rest, since mlockall leaves them out.
``become_io_flusher``
    PR_SET_IO_FLUSHER: the kernel's reclaim, when this process needs a page, never starts or
    waits for swap I/O on its behalf (GFP_NOIO), which would wait for this very process.
``become_realtime``
    SCHED_RR priority 1: the page allocator lets a realtime task's allocations go a quarter
    below the min watermark (ALLOC_HARDER), a reserve the swapping workload and kswapd cannot
    take. Page faults on fresh heap and socket buffers for the memservers are then served
    while everything else waits for free memory. The kernel's RT throttling
    (``sched_rt_runtime_us``, default 950000 of 1000000) bounds a busy realtime task to 95 %
    of a CPU; the daemon only runs while requests or replies are ready.
``lower_oom_score``
    last in the OOM killer's list: killing the server of the swap device loses every page it
    holds for the kernel.

Each function reports failure instead of raising (a process without privilege still runs,
less protected), and `duvm doctor` says what to change (`doctor_host.check_swap_path`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path

from duvm.base.libc import libc

log = logging.getLogger("duvm.base.pressure")

_MCL_CURRENT, _MCL_FUTURE, _MCL_ONFAULT = 1, 2, 4
_PR_SET_IO_FLUSHER = 57
OOM_SCORE_ADJ = -900  # far down the OOM killer's list, yet not immune (-1000)
RT_PRIORITY = 1  # the lowest realtime priority: above every normal task, below the kernel's
RT_RUNTIME = Path("/proc/sys/kernel/sched_rt_runtime_us")
RT_PERIOD = Path("/proc/sys/kernel/sched_rt_period_us")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def lock_in_memory() -> str | None:
    """mlockall (on fault where possible), then every page already out on swap brought back
    (`fault_in_swapped`). None on success, else why it failed."""
    c = libc()
    for flags in (_MCL_CURRENT | _MCL_FUTURE | _MCL_ONFAULT, _MCL_CURRENT | _MCL_FUTURE):
        if c.mlockall(flags) == 0:
            fault_in_swapped()
            return None
    return f"mlockall: {os.strerror(ctypes.get_errno())}"


_SWAPPED = bytes.maketrans(bytes(b for b in range(256) if b & 0x40), b"\x01" * 128)
_USER_TOP = 1 << 47  # above it: [vsyscall], which pagemap does not describe
_SCAN_PAGES = 1 << 16  # pagemap entries read at once (512 KiB)


def fault_in_swapped(
    maps: Path = Path("/proc/self/maps"), pagemap: Path = Path("/proc/self/pagemap")
) -> int:
    """Touch every page of this process that is out on swap; returns how many.

    mlockall with MCL_ONFAULT locks the pages that are resident and those faulted in later,
    but leaves a page already swapped out where it is. A process that started while the node
    swapped (the supervisor and a standby start after swapon, on a node short of memory) can
    have pages of its interpreter out on the duvm device; the first touch after the daemon
    died waited for that device for good (the supervisor's own restart, seen in the QEMU
    guest: its main thread in do_swap_page). Touched once now, each is locked like the rest.
    Bit 62 of a pagemap entry is "swapped" (Documentation/admin-guide/mm/pagemap.rst)."""
    count = 0
    with open(maps) as regions, open(pagemap, "rb", buffering=0) as entries:
        for line in regions:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if "r" not in perms or start >= _USER_TOP:
                continue
            for first in range(start, end, _SCAN_PAGES * _PAGE):  # a huge arena: in pieces
                entries.seek(first // _PAGE * 8)
                raw = entries.read(min(_SCAN_PAGES, (end - first) // _PAGE) * 8)
                flags = raw[7::8].translate(_SWAPPED)  # each entry's top byte: bit 62 -> 1
                at = flags.find(1)
                while at >= 0:
                    ctypes.string_at(first + at * _PAGE, 1)  # a read fault swaps it in
                    count += 1
                    at = flags.find(1, at + 1)
    return count


def become_io_flusher() -> str | None:
    """PR_SET_IO_FLUSHER (Linux 5.6+, CAP_SYS_RESOURCE). None on success, else why not."""
    if libc().prctl(_PR_SET_IO_FLUSHER, 1, 0, 0, 0) == 0:
        return None
    return f"PR_SET_IO_FLUSHER: {os.strerror(ctypes.get_errno())}"


def become_realtime(priority: int = RT_PRIORITY, every_thread: bool = False) -> str | None:
    """SCHED_RR at `priority` for the calling thread (and the threads it starts later), or with
    `every_thread` for every thread the process has now. None on success, else why not."""
    tids = [int(t) for t in os.listdir("/proc/self/task")] if every_thread else [0]
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(priority))
    except OSError as exc:
        return f"SCHED_RR: {exc.strerror or exc}"
    return None


def lower_oom_score(adj: int = OOM_SCORE_ADJ) -> str | None:
    """Ask the OOM killer to pick others first. None on success, else why not."""
    try:
        Path("/proc/self/oom_score_adj").write_text(str(adj))
    except OSError as exc:
        return f"oom_score_adj: {exc.strerror or exc}"
    return None


def realtime_wanted(daemon_args: list[str]) -> bool:
    """Whether the processes beside the daemon (supervisor, nbdfuse) run realtime too: unless
    the daemon's own flags opt out with --no-realtime."""
    return "--no-realtime" not in daemon_args


def inherited_protections() -> None:
    """The protections a program keeps across exec (realtime, I/O flusher), for a helper on the
    swap path that duvm starts but cannot change (nbdfuse). Failures are left to doctor."""
    become_realtime()
    become_io_flusher()


def rt_throttle(runtime: Path = RT_RUNTIME, period: Path = RT_PERIOD) -> tuple[int, int] | None:
    """(runtime, period) in µs of the kernel's RT throttling; runtime -1: throttling off.
    None where the files cannot be read."""
    try:
        return int(runtime.read_text()), int(period.read_text())
    except (OSError, ValueError):
        return None


def protect(
    who: str,
    *,
    realtime: bool = True,
    mlock: bool = True,
    io_flusher: bool = True,
    oom_adj: int = OOM_SCORE_ADJ,
) -> list[str]:
    """Every protection for a process on the swap path; one warning per protection that could
    not be applied (what it risks), returned too for callers that report them elsewhere."""
    risks = {
        "lock": "its pages may be swapped out to the device it serves",
        "flusher": "its reclaim may wait on swap writes to the device it serves",
        "realtime": "under memory pressure it may wait for free memory like every other task",
        "oom": "the OOM killer may pick it",
    }
    steps = [
        ("lock", lock_in_memory if mlock else None),
        ("flusher", become_io_flusher if io_flusher else None),
        ("realtime", become_realtime if realtime else None),
        ("oom", lambda: lower_oom_score(oom_adj)),
    ]
    problems = []
    for name, step in steps:
        why = step() if step is not None else None
        if why is not None:
            problems.append(f"{why}: {risks[name]}")
            log.warning(
                "%s: %s: %s (run as root; `duvm doctor` says what to change)", who, why, risks[name]
            )
    return problems


def probe() -> dict[str, str | None]:
    """Try every protection on this process (meant for a throwaway child: `duvm doctor`);
    name -> None when it applies, else why not."""
    return {
        "mlock": lock_in_memory(),
        "io-flusher": become_io_flusher(),
        "realtime": become_realtime(),
        "oom-score": lower_oom_score(),
    }


def reserve_heap(nbytes: int) -> None:
    """Fault in `nbytes` of malloc heap now and keep it, so request buffers later come from
    resident, locked pages instead of page faults (with the process locked in RAM).

    glibc is told to keep freed memory in its one heap (no per-thread arenas, no mmap for large
    blocks below 32 MiB, no trimming). Off by default: the realtime reserve made it unneeded in
    every measured run, and it costs locked RAM."""
    c = libc()
    m_trim_threshold, m_top_pad, m_mmap_threshold, m_arena_max = -1, -2, -3, -8
    for opt, value in (
        (m_arena_max, 1),
        (m_mmap_threshold, 32 << 20),
        (m_trim_threshold, 2**31 - 1),
        (m_top_pad, 1 << 20),
    ):
        if not c.mallopt(opt, value):
            log.warning("mallopt(%d) refused; heap reserve skipped", opt)
            return
    c.malloc.restype = ctypes.c_void_p
    c.free.argtypes = [ctypes.c_void_p]
    chunk, blocks = 4 << 20, []
    for _ in range(nbytes // chunk):
        p = c.malloc(chunk)
        if not p:
            break
        ctypes.memset(p, 1, chunk)  # touch: resident now, and locked (mlockall)
        blocks.append(p)
    for p in blocks:
        c.free(p)  # back to the heap, which keeps it


def touch_mappings(wanted: Callable[[str], bool], maps: Path = Path("/proc/self/maps")) -> int:
    """Read one byte of every page of this process's readable mappings of the files `wanted`
    accepts (by path), so their pages are resident, and locked under mlockall, before a moment
    that must not fault them in from disk (a standby's takeover). Returns the pages touched."""
    touched = 0
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[1].startswith("r") or not wanted(fields[5]):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        for addr in range(start, end, _PAGE):
            ctypes.c_char.from_address(addr).value  # noqa: B018 - the read is the point
            touched += 1
    return touched


def rss_kib(pid: int | str = "self", field: str = "VmRSS") -> int | None:
    """Resident memory of process `pid` in KiB (`field`: VmRSS, or RssAnon for what it
    allocated itself, RssFile for file pages it maps); None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def mem_available_kib(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's estimate of memory that can be had without swapping (MemAvailable), in
    KiB; None when it cannot be read."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
