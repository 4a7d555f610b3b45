"""Cheap, error-translated reads of /proc for host.py and procinfo.py.

Theory of operation
-------------------
Per-process probes read small /proc files directly instead of going through psutil
objects: one ``open``/``read`` of ``/proc/PID/stat`` gives the name, the CPU ticks and the
start time; ``statm`` gives the exact resident set size (measured against
``psutil.process_iter`` in ``benchmarks/gtm_refresh.py``).

OS errors are translated in exactly one place, `read_proc`, the way psutil does it:

* the file or process is gone (``ENOENT``, ``ESRCH``) -> `NoSuchProcess`
* permission refused (``EACCES``, ``EPERM``; hidepid, another user's ``maps``) -> `AccessDenied`
* anything else -> `ProcError` with the OS message

Each carries a `model.Reason` so callers turn it into a missing `Reading` without guessing.

``create_time`` is computed exactly as psutil computes it on Linux (start ticks divided by
``SC_CLK_TCK`` plus ``btime`` from ``/proc/stat``), so ``(pid, create_time)`` keys built here
equal the keys built from ``psutil.Process.create_time()`` elsewhere in the collector.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from gputaskman.base.readings import Reason

PROC = "/proc"
# os.sysconf: Unix only (the fallbacks are Linux's usual values, for imports on Windows)
CLOCK_TICKS: int = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
PAGE_SIZE: int = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
PF_KTHREAD = 0x00200000  # include/linux/sched.h: "I am a kernel thread"


class ProcError(Exception):
    """A /proc read failed; `reason` is the model reason, `detail` the human text."""

    reason: Reason = Reason.QUERY_FAILED

    def __init__(self, pid: int | None, detail: str) -> None:
        super().__init__(detail)
        self.pid = pid
        self.detail = detail


class NoSuchProcess(ProcError):
    """The process exited (or never existed) before or while it was read."""

    reason = Reason.PROCESS_GONE


class AccessDenied(ProcError):
    """The kernel refused the read (another user's process, hidepid, ptrace checks)."""

    reason = Reason.DENIED


def translate(exc: OSError, pid: int | None, what: str) -> ProcError:
    """Map an OSError from reading `what` of `pid` to the psutil-style error classes."""
    code = exc.errno
    if isinstance(exc, (FileNotFoundError, ProcessLookupError)) or code in (
        errno.ENOENT,
        errno.ESRCH,
    ):
        return NoSuchProcess(pid, f"process {pid} gone while reading {what}")
    if isinstance(exc, PermissionError) or code in (errno.EACCES, errno.EPERM):
        return AccessDenied(pid, f"permission denied reading {what} of process {pid}")
    return ProcError(pid, f"reading {what} of process {pid} failed: {exc.strerror or exc}")


def read_proc(pid: int, name: str, *, root: str = PROC) -> bytes:
    """Bytes of ``/proc/PID/name``; raises `NoSuchProcess`, `AccessDenied` or `ProcError`.

    Uses ``os.open``/``os.read`` rather than ``open()``: no Python file object, about half
    the cost per file on this machine (see the benchmark). Reads until EOF, because a
    multi-record file such as ``maps`` may return short reads before its end.
    """
    try:
        fd = os.open(f"{root}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise translate(exc, pid, name) from None
    try:
        chunks = []
        size = 4096
        while True:
            chunk = os.read(fd, size)
            if not chunk:
                break
            chunks.append(chunk)
            size = 262144  # a big file: take larger bites
        return b"".join(chunks)
    except OSError as exc:
        raise translate(exc, pid, name) from None
    finally:
        os.close(fd)


def read_small(path: str) -> bytes:
    """One ``os.read`` of a single-record /proc file (``stat``, ``statm``): such files are
    produced whole by one ``show()``, so a read shorter than the buffer is the whole file.
    Raises OSError untranslated (the hot per-process loop translates only on failure)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, 4096)
        if len(data) == 4096:  # never for stat/statm; stay correct anyway
            rest = [data]
            while chunk := os.read(fd, 65536):
                rest.append(chunk)
            data = b"".join(rest)
        return data
    finally:
        os.close(fd)


def readlink_proc(pid: int, name: str, *, root: str = PROC) -> str:
    """Target of ``/proc/PID/name`` (``cwd``, ``exe``), with the same error translation."""
    try:
        return os.readlink(f"{root}/{pid}/{name}")
    except OSError as exc:
        raise translate(exc, pid, name) from None


def list_pids(root: str = PROC) -> list[int]:
    """Process ids (thread-group leaders) currently listed in /proc."""
    return [int(n) for n in os.listdir(root) if n.isdigit()]


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of ``/proc/PID/stat`` that gputaskman uses (see proc(5))."""

    name: str  # comm, at most 15 bytes, may contain spaces and parentheses
    state: str
    ppid: int
    flags: int  # PF_* bits; PF_KTHREAD marks a kernel thread
    utime_ticks: int
    stime_ticks: int
    start_ticks: int  # since boot, in SC_CLK_TCK units; with btime, the create time
    rss_pages: int  # approximate on Linux >= 6.2 (per-CPU counter); statm is exact

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(data: bytes) -> Stat | None:
    """Parse ``/proc/PID/stat``; None when the text is not in the kernel's format.

    The name sits between the first ``(`` and the *last* ``)`` because a process may name
    itself ``a) b (c``; everything after is space separated numbers.
    """
    lpar = data.find(b"(")
    rpar = data.rfind(b")")
    if lpar < 0 or rpar < lpar:
        return None
    fields = data[rpar + 2 :].split()
    if len(fields) < 22:
        return None
    try:
        return Stat(
            name=data[lpar + 1 : rpar].decode("utf-8", "replace"),
            state=fields[0].decode("ascii", "replace"),
            ppid=int(fields[1]),
            flags=int(fields[6]),
            utime_ticks=int(fields[11]),
            stime_ticks=int(fields[12]),
            start_ticks=int(fields[19]),
            rss_pages=int(fields[21]),
        )
    except ValueError:
        return None


def read_stat(pid: int, *, root: str = PROC) -> Stat:
    """Read and parse ``/proc/PID/stat``; a malformed file is a `ProcError`."""
    try:
        data = read_small(f"{root}/{pid}/stat")
    except OSError as exc:
        raise translate(exc, pid, "stat") from None
    st = parse_stat(data)
    if st is None:
        raise ProcError(pid, f"unparseable /proc/{pid}/stat")
    return st


def boot_time(root: str = PROC) -> float | None:
    """``btime`` from /proc/stat (Unix seconds), as psutil reads it; None if unreadable."""
    try:
        with open(f"{root}/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime"):
                    return float(line.split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return None


def create_time(start_ticks: int, btime: float) -> float:
    """Unix create time from stat's start ticks; bit-identical to psutil's on Linux."""
    return float(start_ticks) / CLOCK_TICKS + btime
