"""System RAM, swap, CPU load and per-process RAM/CPU, as the OS reports them.

API
---
``HostSampler().sample(pids=None) -> SystemInfo``

* `SystemInfo.memory` (`MemoryInfo`): total, available, used, free, cached, buffers, shared
  bytes from ``/proc/meminfo``.
* `SystemInfo.swap` (`SwapInfo`): totals from ``/proc/meminfo`` and every device listed in
  ``/proc/swaps`` (`SwapDevice`: filename, type, size, used, priority).
* `SystemInfo.cpu` (`CpuInfo`): logical CPUs, load averages, and overall busy percent
  between this sample and the previous one (``/proc/stat``).
* `SystemInfo.duvm` (`duvmpool.PoolInfo` or None): this node's duvm daemon (where its pages
  are, the pool's health) and memserver (what it lends, to whom), kind runtime.
* `SystemInfo.processes`: a read-only mapping pid -> `ProcessUsage` (rss bytes, CPU percent
  of one core, create time) for every process, or only for `pids` when given.

Every number is a `model.Reading` (kind measured, `source` naming the file) except the
per-process values, which are plain numbers with a `model.Reason` beside them to keep 1,000
processes cheap. Unknown is None with a reason, never 0. ``parse_meminfo``,
``parse_swaps`` and ``parse_cpu_line`` are sans-io parsers of the kernel's text formats.

Theory of operation
-------------------
Rates need two samples, so the sampler keeps the previous CPU counters. Per-process
history is keyed by ``(pid, create_time)``: when a PID is reused, the new process has a
different start time, finds no history, and its first CPU percent is None ("first
sample"), never a rate computed against another process's ticks and never 0. History
for processes not seen in the latest sample is dropped, so state stays bounded.

Per-process sampling reads ``/proc/PID/stat`` (name, CPU ticks, start time) and
``/proc/PID/statm`` (resident pages; stat's own rss field is an approximate per-CPU counter
read on Linux >= 6.2 and lags by hundreds of pages) once per process; see
``benchmarks/gtm_refresh.py`` for its measured cost against ``psutil.process_iter``.
Nothing here is GPU memory or ever added to GPU totals; the report shows it under the
JSON key ``system``.

A snapshot's host part is a `HostSample`: a live `SystemInfo`, or a `HostView` (a
recording's host part, `offline.recorded.RecordedSystem`; the demo's,
`fixtures.demo.DemoSystem`), which the report, the text report and the TUI read through
the three methods the protocol declares.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeAlias

from gputaskman.base import procfs
from gputaskman.base.readings import Reading, Reason

MEMINFO = "/proc/meminfo"
SWAPS = "/proc/swaps"
STAT = "/proc/stat"

FIRST_SAMPLE = "first sample of this process: a rate needs two samples"


# --------------------------------------------------------------------------- data


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """System RAM in bytes. ``used = total - available`` (the kernel's own estimate of
    what cannot be reclaimed); the rest are /proc/meminfo fields as reported."""

    total_bytes: Reading
    available_bytes: Reading
    used_bytes: Reading
    free_bytes: Reading
    cached_bytes: Reading
    buffers_bytes: Reading
    shared_bytes: Reading


@dataclass(frozen=True, slots=True)
class SwapDevice:
    """One line of /proc/swaps. Sizes are bytes (the kernel reports KiB); a field the line
    did not carry as a number is None. `deleted` marks a swap file unlinked while active."""

    filename: str
    type: str
    size_bytes: int | None
    used_bytes: int | None
    priority: int | None
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class SwapInfo:
    """Swap totals (from /proc/meminfo) and devices (from /proc/swaps).

    `devices` is None with `devices_reason` when /proc/swaps could not be read; an empty
    tuple means the kernel listed no swap. `problems` names lines that did not parse.
    """

    total_bytes: Reading
    free_bytes: Reading
    used_bytes: Reading
    devices: tuple[SwapDevice, ...] | None
    devices_reason: str | None = None
    problems: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class CpuInfo:
    """Machine CPU load: `percent` is busy time over all CPUs (0-100) since the previous
    sample; the load averages are the kernel's 1, 5 and 15 minute figures."""

    logical_cpus: Reading
    load_1: Reading
    load_5: Reading
    load_15: Reading
    percent: Reading


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """RAM and CPU of one process. `cpu_percent` is of one core (top's convention: 200
    means two busy cores); None on a process's first sample, with `cpu_reason`."""

    pid: int
    create_time: float | None
    name: str | None
    rss_bytes: int | None
    cpu_percent: float | None
    rss_reason: Reason | None = None
    cpu_reason: Reason | None = None
    cpu_detail: str | None = None

    @property
    def key(self) -> tuple[int, float | None]:
        return (self.pid, self.create_time)


@dataclass(frozen=True, slots=True)
class SystemInfo:
    """One host sample. `processes` is a read-only pid -> `ProcessUsage` mapping;
    `processes_reason` is set when the process list itself could not be read."""

    taken: float
    memory: MemoryInfo
    swap: SwapInfo
    cpu: CpuInfo
    processes: Mapping[int, ProcessUsage] = field(default_factory=lambda: MappingProxyType({}))
    processes_reason: str | None = None
    # duvm pool as this node's duvm processes report it (`duvmpool.PoolInfo`, kind runtime);
    # None when not looked for (fixture trees, replays)
    duvm: Any = None


class HostView(Protocol):
    """A host sample that is not a live `SystemInfo`: what the report, the text report and
    the TUI ask of it."""

    def to_json_dict(self) -> Any:
        """The JSON ``system`` object (the shape `report_models.system_json` writes), or None."""
        ...

    def process_readings(self, pid: int, create_time: float | None) -> Mapping[str, Reading]:
        """``ram_bytes`` / ``cpu_percent`` readings of one process; empty when unknown."""
        ...

    def render_lines(self) -> list[str]:
        """The system panel as text lines."""
        ...


#: The host part of a snapshot, as the report, the text report and the TUI take it.
HostSample: TypeAlias = "SystemInfo | HostView"


# --------------------------------------------------------------------------- parsers


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as {field: bytes}. Values in kB are converted; lines that do not
    parse are skipped (the caller treats a missing field as unknown)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        value = int(parts[0])
        if len(parts) > 1:
            if parts[1] != "kB":
                continue  # an unknown unit: refuse to guess
            value *= 1024
        out[key.strip()] = value
    return out


_SWAP_ESCAPES = {"040": " ", "011": "\t", "012": "\n", "134": "\\"}


def unescape_swap_name(name: str) -> str:
    r"""Undo the kernel's octal escaping in /proc/swaps names (``\040`` is a space)."""
    if "\\" not in name:
        return name
    out: list[str] = []
    i = 0
    while i < len(name):
        ch = name[i]
        if ch == "\\" and name[i + 1 : i + 4] in _SWAP_ESCAPES:
            out.append(_SWAP_ESCAPES[name[i + 1 : i + 4]])
            i += 4
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _int_or_none(s: str) -> int | None:
    try:
        return int(s)
    except ValueError:
        return None


def parse_swaps(text: str) -> tuple[tuple[SwapDevice, ...], tuple[str, ...]]:
    """Parse /proc/swaps: (devices, problems).

    Format: a header line, then ``filename type size used priority`` separated by
    whitespace, sizes in KiB. The kernel escapes space, tab, newline and backslash in
    the filename as octal (``\\040``), so the filename never contains whitespace; the
    parser still takes the *last* four fields as type/size/used/priority and joins the
    rest, so an unescaped name from another kernel cannot shift the columns.
    """
    devices: list[SwapDevice] = []
    problems: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("Filename"):
            continue
        parts = line.split()
        if len(parts) < 5:
            problems.append(f"unparseable /proc/swaps line: {raw!r}")
            continue
        name = unescape_swap_name(" ".join(parts[:-4]))
        size, used, prio = (_int_or_none(p) for p in parts[-3:])
        if size is None or used is None or prio is None:
            problems.append(f"non-numeric field in /proc/swaps line: {raw!r}")
        deleted = name.endswith(" (deleted)")
        if deleted:
            name = name[: -len(" (deleted)")]
        devices.append(
            SwapDevice(
                filename=name,
                type=parts[-4],
                size_bytes=None if size is None else size * 1024,
                used_bytes=None if used is None else used * 1024,
                priority=prio,
                deleted=deleted,
            )
        )
    return tuple(devices), tuple(problems)


def parse_cpu_line(text: str) -> tuple[int, int] | None:
    """(busy, total) jiffies from the aggregate ``cpu`` line of /proc/stat, or None.

    total = user+nice+system+idle+iowait+irq+softirq+steal (guest time is already inside
    user and nice); busy = total - idle - iowait, as top computes it.
    """
    for line in text.splitlines():
        if line.startswith("cpu "):
            parts = line.split()[1:9]
            if len(parts) < 4 or not all(p.isdigit() for p in parts):
                return None
            nums = [int(p) for p in parts] + [0] * (8 - len(parts))
            total = sum(nums)
            idle = nums[3] + nums[4]
            return total - idle, total
    return None


# --------------------------------------------------------------------------- sampler


def _read_text(path: str) -> tuple[str | None, str | None]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(), None
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"


def _field(values: dict[str, int] | None, key: str, source: str, why: str | None) -> Reading:
    if values is not None and key in values:
        return Reading.measured(values[key], source)
    detail = why or f"{key} not in {source}"
    return Reading.missing(Reason.UNAVAILABLE, source, detail)


def difference(a: Reading, b: Reading, source: str) -> Reading:
    """a - b when both are known (both measured by the OS), else missing with a reason."""
    if a.value is not None and b.value is not None:
        return Reading.measured(int(a.value) - int(b.value), source)
    return Reading.missing(Reason.UNAVAILABLE, source, "needs both operands")


class HostSampler:
    """Samples the machine; keeps the previous counters so rates can be computed.

    Not thread-safe: use one sampler per collecting thread. `root` points at /proc (tests
    may point it elsewhere for per-process reads).
    """

    def __init__(self, *, proc_root: str = procfs.PROC, duvm: bool | None = None) -> None:
        self._root = proc_root
        # Ask duvm's local status sockets (duvmpool) only on the real machine by default.
        self._duvm = proc_root == procfs.PROC if duvm is None else duvm
        self._btime = procfs.boot_time(proc_root)
        self._cpu_prev: tuple[int, int] | None = None
        # (pid, create_time) -> (cpu ticks, monotonic seconds) from the previous sample.
        self._proc_prev: dict[tuple[int, float], tuple[int, float]] = {}

    @property
    def proc_root(self) -> str:
        """Where /proc is read (a fixture tree's in tests)."""
        return self._root

    # -- machine-wide

    def memory_and_swap(self) -> tuple[MemoryInfo, SwapInfo]:
        text, why = _read_text(MEMINFO)
        mi = parse_meminfo(text) if text is not None else None
        src = MEMINFO
        total = _field(mi, "MemTotal", src, why)
        avail = _field(mi, "MemAvailable", src, why)
        memory = MemoryInfo(
            total_bytes=total,
            available_bytes=avail,
            used_bytes=difference(total, avail, f"{src} (MemTotal - MemAvailable)"),
            free_bytes=_field(mi, "MemFree", src, why),
            cached_bytes=_field(mi, "Cached", src, why),
            buffers_bytes=_field(mi, "Buffers", src, why),
            shared_bytes=_field(mi, "Shmem", src, why),
        )
        stotal = _field(mi, "SwapTotal", src, why)
        sfree = _field(mi, "SwapFree", src, why)
        stext, swhy = _read_text(SWAPS)
        if stext is None:
            devices, problems = None, ()
        else:
            devices, problems = parse_swaps(stext)
        swap = SwapInfo(
            total_bytes=stotal,
            free_bytes=sfree,
            used_bytes=difference(stotal, sfree, f"{src} (SwapTotal - SwapFree)"),
            devices=devices,
            devices_reason=swhy,
            problems=problems,
        )
        return memory, swap

    def cpu(self) -> CpuInfo:
        n = os.cpu_count()
        logical = (
            Reading.measured(n, "os.cpu_count")
            if n
            else Reading.missing(Reason.UNAVAILABLE, "os.cpu_count")
        )
        try:
            loads: tuple[float, ...] | None = os.getloadavg()
            lwhy = None
        except OSError as exc:
            loads, lwhy = None, f"getloadavg failed: {exc}"
        lsrc = "/proc/loadavg"

        def load(i: int) -> Reading:
            if loads is None:
                return Reading.missing(Reason.UNAVAILABLE, lsrc, lwhy)
            return Reading.measured(loads[i], lsrc)

        text, why = _read_text(STAT)
        now = parse_cpu_line(text) if text is not None else None
        prev, self._cpu_prev = self._cpu_prev, now
        if now is None:
            percent = Reading.missing(Reason.UNAVAILABLE, STAT, why or "no cpu line in /proc/stat")
        elif prev is None:
            percent = Reading.missing(
                Reason.UNAVAILABLE, STAT, "first sample: a rate needs two samples"
            )
        elif now[1] <= prev[1]:
            percent = Reading.missing(Reason.UNAVAILABLE, STAT, "no CPU time passed")
        else:
            busy = max(0, now[0] - prev[0])
            percent = Reading.measured(
                min(100.0, 100.0 * busy / (now[1] - prev[1])), f"{STAT} (busy/total delta)"
            )
        return CpuInfo(logical, load(0), load(1), load(2), percent)

    # -- per process

    def processes(self, pids: Iterable[int] | None = None) -> dict[int, ProcessUsage]:
        """RSS and CPU% per process. Raises OSError only if /proc cannot be listed."""
        root = self._root
        pid_list = procfs.list_pids(root) if pids is None else list(pids)
        btime = self._btime
        prev = self._proc_prev
        seen: dict[tuple[int, float], tuple[int, float]] = {}
        out: dict[int, ProcessUsage] = {}
        page = procfs.PAGE_SIZE
        hz = float(procfs.CLOCK_TICKS)
        read_small = procfs.read_small
        translate = procfs.translate
        for pid in pid_list:
            try:
                data = read_small(f"{root}/{pid}/stat")
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited since listing: not a process any more, not a row
            except OSError as exc:
                err = translate(exc, pid, "stat")
                if err.reason is Reason.PROCESS_GONE:
                    continue
                out[pid] = ProcessUsage(
                    pid, None, None, None, None, err.reason, err.reason, err.detail
                )
                continue
            now = time.monotonic()
            # Inline parse of the three stat fields needed (same rules as procfs.parse_stat,
            # without building an object: this loop runs for every process).
            rpar = data.rfind(b")")
            fields = data[rpar + 2 :].split()
            try:
                ticks = int(fields[11]) + int(fields[12])
                start = int(fields[19])
                kthread = int(fields[6]) & procfs.PF_KTHREAD
            except (IndexError, ValueError):
                out[pid] = ProcessUsage(
                    pid,
                    None,
                    None,
                    None,
                    None,
                    Reason.QUERY_FAILED,
                    Reason.QUERY_FAILED,
                    "unparseable /proc/PID/stat",
                )
                continue
            name = data[data.find(b"(") + 1 : rpar].decode("utf-8", "replace")
            # RSS from statm, not stat: since Linux 6.2 stat's rss is the per-CPU counter's
            # fast approximate read and can lag by hundreds of pages; statm sums exactly
            # (and is what psutil, ps and top show).
            rss: int | None
            rss_reason: Reason | None = None
            try:
                # A kernel thread has no user memory: statm would read all zeros.
                rss = 0 if kthread else int(read_small(f"{root}/{pid}/statm").split()[1]) * page
            except (FileNotFoundError, ProcessLookupError):
                continue
            except (OSError, IndexError, ValueError) as exc:
                rss = None
                rss_reason = (
                    translate(exc, pid, "statm").reason
                    if isinstance(exc, OSError)
                    else Reason.QUERY_FAILED
                )
            if btime is None:
                out[pid] = ProcessUsage(
                    pid,
                    None,
                    name,
                    rss,
                    None,
                    rss_reason,
                    Reason.UNAVAILABLE,
                    "boot time unknown (/proc/stat)",
                )
                continue
            ct = start / hz + btime  # == procfs.create_time(start, btime), inlined
            key = (pid, ct)
            seen[key] = (ticks, now)
            last = prev.get(key)
            if last is None:
                cpu, creason, cdetail = None, Reason.UNAVAILABLE, FIRST_SAMPLE
            elif now <= last[1] or ticks < last[0]:
                cpu, creason, cdetail = None, Reason.UNAVAILABLE, "counters did not advance"
            else:
                cpu = 100.0 * (ticks - last[0]) / hz / (now - last[1])
                creason, cdetail = None, None
            out[pid] = ProcessUsage(pid, ct, name, rss, cpu, rss_reason, creason, cdetail)
        if pids is None:
            self._proc_prev = seen
        else:
            # A partial sample must not forget history of processes it did not look at.
            prev.update(seen)
            if len(prev) > 4 * max(len(seen), 1024):
                self._proc_prev = seen
        return out

    def sample(self, pids: Iterable[int] | None = None) -> SystemInfo:
        """One sample of the machine; `pids` restricts the per-process part (None = all)."""
        taken = time.time()
        memory, swap = self.memory_and_swap()
        cpu = self.cpu()
        try:
            procs = self.processes(pids)
            preason = None
        except OSError as exc:
            procs, preason = {}, f"cannot list processes: {exc.strerror or exc}"
        pool = None
        if self._duvm:
            from gputaskman.sampling import duvmpool

            pool = duvmpool.sample()
        return SystemInfo(taken, memory, swap, cpu, MappingProxyType(procs), preason, pool)
