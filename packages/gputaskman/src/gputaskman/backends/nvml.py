"""Thin, lazy wrapper over NVML (`pynvml` from the `nvidia-ml-py` package) for Linux NVIDIA.

Theory of operation
-------------------
`NvmlBackend` is a `gpusource.GpuSource`: `sample()` returns a `GpuSample` (backend
``nvml``): adapters, device metrics, the per-process rows NVML lists (`GpuProcess`), and
every problem it met, each with a `Reason`. It never raises for an NVML error, and it never
turns an error into a number.

* **Lazy init.** `pynvml` is imported and `nvmlInit()` called on the first sample, not at
  import. A failed init (no library, no driver) is remembered with its reason: a missing
  library does not appear while we run, and retrying dlopen every refresh costs for nothing.
* **One error map.** `reason_for()` is the only place an `NVMLError` kind becomes a
  `Reason` (LibraryNotFound -> library not found, DriverNotLoaded -> driver not loaded,
  NoPermission -> denied, NotSupported/FunctionNotFound -> not supported, GpuIsLost ->
  gpu lost, ...). Every reading goes through `_call()`, which applies it.
* **Hidden is not zero.** `usedGpuMemory` of `None` (pynvml's translation of
  NVML_VALUE_NOT_AVAILABLE) or the raw sentinel itself means the driver withholds the
  process's memory (containers, permissions): a missing reading with `Reason.HIDDEN`.
* **A failed list is a failure.** When `nvmlDeviceGet{Compute,Graphics}RunningProcesses`
  fails, the sample carries a `processes.compute` / `processes.graphics` problem for that
  adapter; it is never reported as an empty list.
* **Pairing by PCI bus id.** Adapters are keyed by their PCI bus id, never by name or index;
  an adapter seen in an earlier sample and absent now is kept, with every metric missing
  (`gpu lost`), so a GPU that falls off the bus is visible as such rather than vanishing.
  A GPU lost in the middle of a sample (GpuIsLost from any call) marks the rest of that
  adapter's readings lost too, without further calls.

Engine use per process comes from `nvmlDeviceGetProcessUtilization`, which returns samples
newer than the last timestamp we pass; engine readings are independent of memory.

Each GPU's health readings (`nvml_health`: XID events without blocking, ECC, retired pages,
remapped rows, clock event reasons, fan, PCIe and NVLink rates) and MIG state (`nvml_mig`) go
into `GpuSample.health` and `GpuSample.mig`; on a GPU in MIG mode the processes are listed per
MIG instance and the parent's own lists are not asked, so no process counts twice.

Not validated on hardware in this repository: the machine that built it has no GPU; the
paths are exercised by tests/test_nvml_mocked.py through recorded/mocked NVML responses.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from gputaskman.backends.nvml_calls import (
    NOT_AVAILABLE_UINT,
    NOT_AVAILABLE_ULL,
    call,
    normalise_bus_id,
    reason_for,
    used_memory,
)
from gputaskman.backends.nvml_calls import Lost as _Lost
from gputaskman.backends.nvml_calls import detail_of as _detail
from gputaskman.backends.nvml_calls import number as _number
from gputaskman.backends.nvml_calls import text_of as _text
from gputaskman.backends.nvml_health import NvmlHealth
from gputaskman.backends.nvml_mig import NvmlMig
from gputaskman.base.gpuhealth import HEALTH_FIELDS
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import Adapter, DeviceMetrics, MigState, Problem, Reading, Reason

__all__ = [  # the shared names tests and the TCC backend take from here
    "NOT_AVAILABLE_UINT",
    "NOT_AVAILABLE_ULL",
    "NvmlBackend",
    "normalise_bus_id",
    "reason_for",
]

BACKEND = "nvml"
VENDOR = "nvidia"
T = TypeVar("T")

LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux


def _library_missing() -> str | None:
    """Why the NVML library cannot be loaded, or None when it can.

    Loads the library the way pynvml does (``CDLL("libnvidia-ml.so.1")``) before importing
    pynvml, because importing the binding costs about half a second (measured on the
    development VM) and is wasted on a machine without the driver.
    """
    if not sys.platform.startswith("linux"):
        return None  # other platforms load a different file; let pynvml decide
    try:
        ctypes.CDLL(LIBRARY)
    except OSError as exc:
        return f"NVML Shared Library Not Found ({exc})"
    return None


class NvmlBackend(GpuSource):
    """Lazily initialised NVML. `lib` is the pynvml module (tests pass a mocked one)."""

    def __init__(
        self, lib: ModuleType | Any | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._lib = lib
        self._clock = clock  # wall clock: how long XID events have been watched
        self._health: NvmlHealth | None = None  # made once the library is loaded
        self._mig: NvmlMig | None = None
        self._ready = False
        self._init_problem: Problem | None = None
        self._lock = threading.Lock()
        self._seen: dict[str, Adapter] = {}  # bus id -> adapter, from earlier samples
        self._util_ts: dict[str, int] = {}  # bus id -> last process-utilisation timestamp

    # -- lifecycle

    def _init(self) -> Problem | None:
        if self._ready or self._init_problem is not None:
            return self._init_problem
        try:
            if self._lib is None:
                missing = _library_missing()
                if missing is not None:
                    self._init_problem = Problem("backend.init", Reason.NO_LIBRARY, missing)
                    return self._init_problem
                import pynvml  # lazy: importing gputaskman never loads the binding

                self._lib = pynvml
            self._lib.nvmlInit()
        except Exception as exc:  # any failure here means no NVML at all
            self._init_problem = Problem("backend.init", reason_for(exc), _detail(exc))
            return self._init_problem
        self._ready = True
        self._health = NvmlHealth(self._lib, self._clock)
        self._mig = NvmlMig(self._lib)
        return None

    def close(self) -> None:
        with self._lock:
            if self._ready:
                if self._health is not None:
                    self._health.close()  # the XID event set, before the library goes
                # shutting down a broken driver must not raise
                with contextlib.suppress(Exception):
                    self._lib.nvmlShutdown()
                self._ready = False

    # -- sampling

    def sample(self) -> GpuSample:
        with self._lock:
            problem = self._init()
            if problem is not None:
                return GpuSample(BACKEND, problems=(problem,), backend_problem=problem)
            return self._sample()

    def _sample(self) -> GpuSample:
        lib = self._lib
        problems: list[Problem] = []
        driver = None
        try:
            driver = _text(lib.nvmlSystemGetDriverVersion())
        except Exception as exc:
            problems.append(Problem("system.driver_version", reason_for(exc), _detail(exc)))
        try:
            count = int(lib.nvmlDeviceGetCount())
        except Exception as exc:
            p = Problem("backend.device_count", reason_for(exc), _detail(exc))
            return GpuSample(BACKEND, problems=(p,), backend_problem=p, driver_version=driver)

        adapters: list[Adapter] = []
        metrics: dict[str, DeviceMetrics] = {}
        procs: list[GpuProcess] = []
        health: dict[str, dict[str, Reading]] = {}
        mig: dict[str, MigState] = {}
        assert self._health is not None and self._mig is not None
        self._health.begin()
        for index in range(count):
            try:
                handle = lib.nvmlDeviceGetHandleByIndex(index)
                bus = normalise_bus_id(_text(lib.nvmlDeviceGetPciInfo(handle).busId) or "")
            except Exception as exc:
                problems.append(Problem(f"device.{index}", reason_for(exc), _detail(exc)))
                continue
            if not bus:
                problems.append(Problem(f"device.{index}", Reason.QUERY_FAILED, "no PCI bus id"))
                continue
            adapter = Adapter(
                index=index,
                vendor=VENDOR,
                name=self._optional_text(lambda h=handle: lib.nvmlDeviceGetName(h)),
                uuid=self._optional_text(lambda h=handle: lib.nvmlDeviceGetUUID(h)),
                pci_bus_id=bus,
                backend=BACKEND,
            )
            adapters.append(adapter)
            self._seen[bus] = adapter
            try:
                metrics[bus] = self._metrics(handle)
                mig[bus], on_instances = self._mig.read(handle, bus, problems, self._engines)
                if on_instances is None:
                    procs.extend(self._processes(handle, bus, problems))
                else:  # MIG: every process is listed on its instance, none on the parent
                    procs.extend(on_instances)
                self._health.watch(handle, bus)
                health[bus] = self._health.counters(handle, bus)
            except _Lost as lost:
                # readings taken before the loss stay; the rest are lost
                metrics.setdefault(
                    bus, DeviceMetrics.all_missing(Reason.GPU_LOST, "nvml", lost.detail)
                )
                _lost_state(bus, lost.detail, health, mig)
                for kind in ("compute", "graphics"):
                    problems.append(Problem(f"processes.{kind}", Reason.GPU_LOST, lost.detail, bus))

        present = {a.pci_bus_id for a in adapters}
        for bus, old in self._seen.items():
            if bus in present:
                continue
            # Seen before, gone now: keep it visible as lost instead of silently dropping it.
            detail = "adapter no longer enumerated by NVML"
            adapters.append(Adapter(old.index, old.vendor, old.name, old.uuid, bus, old.backend))
            metrics[bus] = DeviceMetrics.all_missing(Reason.GPU_LOST, "nvml", detail)
            _lost_state(bus, detail, health, mig)
            problems.append(Problem("adapter", Reason.GPU_LOST, detail, bus))
            for kind in ("compute", "graphics"):
                problems.append(Problem(f"processes.{kind}", Reason.GPU_LOST, detail, bus))
        problems.extend(self._health.drain())  # XID events pending now, without waiting
        for bus in health:
            if not _all_lost(health[bus]):
                health[bus] = {**self._health.xid(bus), **health[bus]}
        return GpuSample(
            BACKEND,
            tuple(adapters),
            metrics,
            tuple(procs),
            tuple(problems),
            None,
            driver,
            health=health,
            mig=mig,
        )

    @staticmethod
    def _optional_text(fn: Callable[[], Any]) -> str | None:
        try:
            return _text(fn())
        except Exception:  # a name or UUID we cannot read is shown as n/a
            return None

    @staticmethod
    def _call(fn: Callable[[], T], source: str) -> tuple[T | None, Reading | None]:
        """`nvml_calls.call`: a value, or a missing reading; a lost GPU raises `_Lost`."""
        return call(fn, source)

    def _metrics(self, h: Any) -> DeviceMetrics:
        lib = self._lib

        def read(fn: Callable[[], Any], api: str, scale: float = 1.0) -> Reading:
            value, missing = self._call(fn, api)
            if missing is not None:
                return missing
            return _number(value, api, scale)

        mem, mem_missing = self._call(
            lambda: lib.nvmlDeviceGetMemoryInfo(h, version=lib.nvmlMemory_v2),
            "nvmlDeviceGetMemoryInfo",
        )
        api = "nvmlDeviceGetMemoryInfo"
        if mem is not None:
            total, used = _number(mem.total, api), _number(mem.used, api)
            reserved = _number(mem.reserved, api)
        else:
            # v2 (with reserved) needs driver >= 510; v1 still gives total and used.
            mem1, missing1 = self._call(lambda: lib.nvmlDeviceGetMemoryInfo(h), api)
            if mem1 is None:
                total = used = reserved = missing1  # type: ignore[assignment]
            else:
                total, used = _number(mem1.total, api), _number(mem1.used, api)
                reserved = mem_missing  # type: ignore[assignment]
        util, util_missing = self._call(
            lambda: lib.nvmlDeviceGetUtilizationRates(h), "nvmlDeviceGetUtilizationRates"
        )
        uapi = "nvmlDeviceGetUtilizationRates"
        util_gpu = util_missing if util is None else _number(util.gpu, uapi)
        util_mem = util_missing if util is None else _number(util.memory, uapi)
        return DeviceMetrics(
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_reserved_bytes=reserved,
            util_gpu_percent=util_gpu,  # type: ignore[arg-type]
            util_memory_percent=util_mem,  # type: ignore[arg-type]
            encoder_percent=read(
                lambda: lib.nvmlDeviceGetEncoderUtilization(h)[0],
                "nvmlDeviceGetEncoderUtilization",
            ),
            decoder_percent=read(
                lambda: lib.nvmlDeviceGetDecoderUtilization(h)[0],
                "nvmlDeviceGetDecoderUtilization",
            ),
            temperature_c=read(
                lambda: lib.nvmlDeviceGetTemperature(h, lib.NVML_TEMPERATURE_GPU),
                "nvmlDeviceGetTemperature",
            ),
            power_w=read(lambda: lib.nvmlDeviceGetPowerUsage(h), "nvmlDeviceGetPowerUsage", 1e-3),
            power_limit_w=read(
                lambda: lib.nvmlDeviceGetEnforcedPowerLimit(h),
                "nvmlDeviceGetEnforcedPowerLimit",
                1e-3,
            ),
            clock_graphics_mhz=read(
                lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_GRAPHICS),
                "nvmlDeviceGetClockInfo",
            ),
            clock_sm_mhz=read(
                lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM), "nvmlDeviceGetClockInfo"
            ),
            clock_memory_mhz=read(
                lambda: lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_MEM), "nvmlDeviceGetClockInfo"
            ),
        )

    def _processes(self, h: Any, bus: str, problems: list[Problem]) -> list[GpuProcess]:
        lib = self._lib
        rows: dict[int, tuple[list[str], Reading | None]] = {}
        for kind, api, fn in (
            (
                "compute",
                "nvmlDeviceGetComputeRunningProcesses",
                lib.nvmlDeviceGetComputeRunningProcesses,
            ),
            (
                "graphics",
                "nvmlDeviceGetGraphicsRunningProcesses",
                lib.nvmlDeviceGetGraphicsRunningProcesses,
            ),
        ):
            listed, missing = self._call(lambda fn=fn: fn(h), api)
            if missing is not None:
                problems.append(
                    Problem(f"processes.{kind}", missing.reason, missing.detail, bus)  # type: ignore[arg-type]
                )
                continue
            for info in listed or ():
                pid = int(info.pid)
                r = used_memory(info, api)  # hidden by the driver is never 0
                contexts, prev = rows.get(pid, ([], None))
                contexts.append(kind)
                # A process in both lists reports the same per-process figure; keep the
                # first known one rather than adding them (that would double count).
                rows[pid] = (contexts, prev if prev is not None and prev.known else r)
        engines = self._engines(h, bus, set(rows))
        return [
            GpuProcess(pid, bus, tuple(ctx), r, engines.get(pid) or {})  # type: ignore[arg-type]
            for pid, (ctx, r) in sorted(rows.items())
        ]

    def _engines(self, h: Any, bus: str, pids: set[int]) -> dict[int, dict[str, Reading]]:
        """Per-process engine use since the last sample; independent of memory."""
        if not pids:
            return {}
        api = "nvmlDeviceGetProcessUtilization"
        lib = self._lib
        since = self._util_ts.get(bus, int((time.time() - 2.0) * 1e6))
        samples, missing = self._call(lambda: lib.nvmlDeviceGetProcessUtilization(h, since), api)
        out: dict[int, dict[str, Reading]] = {}
        if missing is not None:
            return {pid: _engine_missing(missing) for pid in pids}
        latest: dict[int, Any] = {}
        for s in samples or ():
            if int(s.pid) in pids and (
                int(s.pid) not in latest or s.timeStamp > latest[int(s.pid)].timeStamp
            ):
                latest[int(s.pid)] = s
            self._util_ts[bus] = max(self._util_ts.get(bus, 0), int(s.timeStamp))
        for pid in pids:
            s = latest.get(pid)
            if s is None:
                gone = Reading.missing(Reason.UNAVAILABLE, f"nvml:{api}", "no sample this period")
                out[pid] = _engine_missing(gone)
                continue
            out[pid] = {
                "gpu_percent": _number(s.smUtil, api),
                "memory_percent": _number(s.memUtil, api),
                "encoder_percent": _number(s.encUtil, api),
                "decoder_percent": _number(s.decUtil, api),
            }
        return out


def _lost_state(
    bus: str, detail: str, health: dict[str, dict[str, Reading]], mig: dict[str, MigState]
) -> None:
    """A lost GPU's health readings and MIG state: every one lost (those taken stay)."""
    lost = Reading.missing(Reason.GPU_LOST, "nvml", detail)
    health[bus] = dict.fromkeys(HEALTH_FIELDS, lost)
    mig.setdefault(bus, MigState(lost))


def _all_lost(h: dict[str, Reading]) -> bool:
    return all(r.reason is Reason.GPU_LOST for r in h.values())


def _engine_missing(r: Reading) -> dict[str, Reading]:
    return {k: r for k in ("gpu_percent", "memory_percent", "encoder_percent", "decoder_percent")}
