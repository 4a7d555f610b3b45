"""The host panel where there is no /proc (Windows, macOS): what the platform modules can
read, and every other field unknown with the reason.

Theory of operation
-------------------
`default_sampler()` gives the collector its host sampler: `host.HostSampler` wherever /proc
is the interface (Linux, WSL), a `PlatformHostSampler` on Windows and macOS, which never
opens a /proc path. It returns the same `host.SystemInfo`, so the report, the TUI and the
exporter need nothing new, and it reads only interfaces the GPU backends already use:

* **macOS**: total RAM from ``sysctl hw.memsize`` (`macos.sysctl_memsize`, the Metal
  backend's unified-memory total); the load averages from ``getloadavg(3)``.
* **Windows**: PDH, through the same `win.pdh.PdhApi` the WDDM backend reads:
  ``\\Memory\\Available Bytes`` and ``\\Processor(_Total)\\% Processor Time`` (a rate:
  the first collection has none). Windows has no load average.

Everything else (used/free/cached RAM, swap, per-process RAM and CPU) is not read on these
systems yet: each reading is missing with reason ``not supported`` and a detail that says
so, the swap device list is None with a reason, and `processes_reason` says why no process
has RAM/CPU. Nothing is ever 0 for want of a source. Not validated on Windows or macOS
hardware; tests use the mocked PDH and memsize answers.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

from gputaskman.base.readings import Reading, Reason
from gputaskman.sampling import host

OS_NAMES = {"win32": "Windows", "darwin": "macOS"}
NO_PROCESSES = "per-process RAM and CPU are read from /proc, which {os} does not have"
MEMSIZE = "sysctl:hw.memsize"
LOADAVG = "getloadavg"


def default_sampler(sys_platform: str | None = None) -> host.HostSampler | PlatformHostSampler:
    """`host.HostSampler` where /proc exists; a `PlatformHostSampler` on Windows/macOS."""
    plat = sys.platform if sys_platform is None else sys_platform
    if plat in OS_NAMES:
        return PlatformHostSampler(plat)
    return host.HostSampler()


class PlatformHostSampler:
    """`host.HostSampler`'s interface (``sample(pids=None) -> SystemInfo``) for Windows
    (``win32``) and macOS (``darwin``). `pdh` (Windows) and `memsize` (macOS) are the
    platform modules' seams; by default the real ones, loaded on first use."""

    def __init__(
        self,
        sys_platform: str,
        *,
        pdh: Any = None,
        memsize: Callable[[], int | None] | None = None,
        loadavg: Callable[[], tuple[float, float, float]] | None = None,
    ) -> None:
        if sys_platform not in OS_NAMES:
            raise ValueError(f"no platform host sampler for {sys_platform!r}")
        self.platform = sys_platform
        self.os_name = OS_NAMES[sys_platform]
        self._pdh = pdh
        self._memsize = memsize
        if sys_platform == "win32":
            self._loadavg = None  # Windows keeps no load average
        else:
            self._loadavg = loadavg if loadavg is not None else os.getloadavg

    def close(self) -> None:
        if self._pdh is not None:
            self._pdh.close()

    def _unread(self, source: str) -> Reading:
        return Reading.missing(Reason.NOT_SUPPORTED, source, f"not read on {self.os_name} yet")

    def _pdh_reads(self) -> dict[str, Reading]:
        from gputaskman.backends.win import pdh as pdh_mod

        if self._pdh is None:
            self._pdh = pdh_mod.CtypesPdh()
        try:
            reads = self._pdh.read(pdh_mod.HOST_COUNTERS)
        except OSError as exc:  # pdh.dll missing or the query could not be opened
            failed = pdh_mod.CounterRead.failed(0, str(exc))
            return {p: pdh_mod.machine_reading(failed, p) for p in pdh_mod.HOST_COUNTERS}
        return {p: pdh_mod.machine_reading(reads.get(p), p) for p in pdh_mod.HOST_COUNTERS}

    def _total_bytes(self) -> Reading:
        if self.platform != "darwin":
            return self._unread("GlobalMemoryStatusEx")
        if self._memsize is None:
            from gputaskman.backends.macos import sysctl_memsize

            self._memsize = sysctl_memsize
        total = self._memsize()
        if total is None or total <= 0:
            return Reading.missing(Reason.QUERY_FAILED, MEMSIZE, "sysctl hw.memsize failed")
        return Reading.measured(total, MEMSIZE)

    def _loads(self) -> tuple[Reading, Reading, Reading]:
        if self._loadavg is None:
            why = Reading.missing(
                Reason.NOT_SUPPORTED, LOADAVG, f"{self.os_name} has no load average"
            )
            return why, why, why
        try:
            loads = self._loadavg()
        except OSError as exc:
            why = Reading.missing(Reason.QUERY_FAILED, LOADAVG, str(exc))
            return why, why, why
        a, b, c = (Reading.measured(v, LOADAVG) for v in loads)
        return a, b, c

    def sample(self, pids: Iterable[int] | None = None) -> host.SystemInfo:
        """One sample; `pids` is accepted for `HostSampler`'s interface (no process is
        read on these systems yet)."""
        taken = time.time()
        total = self._total_bytes()
        available = self._unread("vm_statistics64")
        cpu_percent = self._unread("host_processor_info")
        if self.platform == "win32":
            from gputaskman.backends.win import pdh as pdh_mod

            got = self._pdh_reads()
            available = got[pdh_mod.MEMORY_AVAILABLE]
            cpu_percent = got[pdh_mod.PROCESSOR_TIME]
            if cpu_percent.value is not None:
                cpu_percent = Reading.measured(
                    min(100.0, float(cpu_percent.value)), cpu_percent.source
                )
        memory = host.MemoryInfo(
            total_bytes=total,
            available_bytes=available,
            used_bytes=host.difference(total, available, "total - available"),
            free_bytes=self._unread("free"),
            cached_bytes=self._unread("cached"),
            buffers_bytes=self._unread("buffers"),
            shared_bytes=self._unread("shared"),
        )
        swap = host.SwapInfo(
            total_bytes=self._unread("swap"),
            free_bytes=self._unread("swap"),
            used_bytes=self._unread("swap"),
            devices=None,
            devices_reason=f"swap devices are not read on {self.os_name} yet",
        )
        n = os.cpu_count()
        logical = (
            Reading.measured(n, "os.cpu_count")
            if n
            else Reading.missing(Reason.UNAVAILABLE, "os.cpu_count")
        )
        cpu = host.CpuInfo(logical, *self._loads(), cpu_percent)
        return host.SystemInfo(
            taken,
            memory,
            swap,
            cpu,
            MappingProxyType({}),
            NO_PROCESSES.format(os=self.os_name),
            None,
        )
