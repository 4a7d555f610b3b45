"""macOS (Apple Silicon): Metal clients from IOKit, memory from the system's accounting.

Theory of operation
-------------------
`MacCounters` is a `gpusource.GpuSource`; its `sample()` returns a `GpuSample` (backend
``metal``) built from two interfaces that tests replace:

* `IOKitApi.accelerators()`: every ``IOAccelerator`` service (``AGXAccelerator*`` on
  Apple Silicon) with its ``PerformanceStatistics`` dictionary and the properties of its
  user clients, which are its *children in the service plane* (they are not registered
  services, so matching on the client class finds none). A client names its owner in
  ``IOUserClientCreator`` (``"pid 533, WindowServer"``) and carries GPU time in
  nanoseconds, in ``AppUsage[].accumulatedGPUTime`` (Apple Silicon) or
  ``accumulatedGPUTime`` (Intel Macs). These are readable without root, for every user's
  processes.
* `FootprintApi`: per process, the phys footprint from ``proc_pid_rusage`` (own-user
  processes without root; another user's process answers EPERM: ``denied``, never a
  guess) and, only when a task port can be had (root, not a platform binary), the graphics
  ledgers of ``TASK_VM_INFO``: ``ledger_tag_graphics_footprint`` (the process's GPU bytes)
  and ``ledger_tag_graphics_footprint_compressed`` (the Paged column).

Device readings: memory in use is ``PerformanceStatistics["In use system memory"]``,
utilisation ``"Device Utilization %"``, total the machine's unified memory (``hw.memsize``;
the GPU shares it with the CPU, so the detail says so). Per-process GPU % is the rate of
the client's accumulated GPU time between two samples: the first sample has none (``needs
two samples``), and a counter that went backwards (a client closed) gives none either.

A process's footprint counts CPU *and* GPU memory, so it is a separate reading, never
the VRAM figure and never summed. The ctypes layers (`CtypesIOKit`, `CtypesFootprint`)
load IOKit, CoreFoundation and libSystem by absolute path and are used only on macOS.
Not validated on Apple hardware: tests use mocked IOKit and footprint answers.
"""

from __future__ import annotations

import ctypes
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import Adapter, DeviceMetrics, Kind, Problem, Reading, Reason

BACKEND: Final = "metal"
PERF = "iokit:PerformanceStatistics"
IN_USE = "In use system memory"
DEVICE_UTIL = "Device Utilization %"
_CREATOR = re.compile(r"^\s*pid\s+(\d+)\s*(?:,\s*(.*?))?\s*$")


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One IOAccelerator service: registry id, class, properties and its clients'."""

    registry_id: int
    class_name: str
    properties: Mapping[str, Any] = field(default_factory=dict)
    clients: Sequence[Mapping[str, Any]] = ()

    @property
    def key(self) -> str:
        return f"iokit:{self.registry_id:#x}"

    @property
    def perf(self) -> Mapping[str, Any] | None:
        p = self.properties.get("PerformanceStatistics")
        return p if isinstance(p, Mapping) else None


class IOKitApi(Protocol):
    def accelerators(self) -> list[Accelerator]: ...


class FootprintApi(Protocol):
    """Raise PermissionError (another user's process, no task port), ProcessLookupError
    (gone), or OSError (anything else)."""

    def phys_footprint(self, pid: int) -> int: ...

    def graphics(self, pid: int) -> tuple[int, int]: ...  # (footprint, compressed)


def parse_creator(text: Any) -> tuple[int, str | None] | None:
    """(pid, name) from ``IOUserClientCreator`` (``"pid 533, WindowServer"``)."""
    if not isinstance(text, str):
        return None
    m = _CREATOR.match(text)
    if m is None:
        return None
    return int(m[1]), (m[2] or None)


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return int(v) if v >= 0 else None


def gpu_time_ns(props: Mapping[str, Any]) -> int | None:
    """A client's accumulated GPU time (ns), or None when it publishes none."""
    direct = _int(props.get("accumulatedGPUTime"))
    if direct is not None:
        return direct
    usage = props.get("AppUsage")
    if not isinstance(usage, Sequence) or isinstance(usage, str | bytes):
        return None
    found, total = False, 0
    for entry in usage:
        if isinstance(entry, Mapping):
            v = _int(entry.get("accumulatedGPUTime"))
            if v is not None:
                found, total = True, total + v
    return total if found else None


def _reading(v: Any, source: str, what: str) -> Reading:
    n = v if isinstance(v, int | float) and not isinstance(v, bool) else None
    if n is None or n < 0:
        return Reading.missing(Reason.UNAVAILABLE, source, f"IOKit gave no {what}")
    return Reading.measured(n, source)


class MacCounters(GpuSource):
    """IOKit + footprint poller. `clock` is monotonic seconds (a seam for rate tests)."""

    def __init__(
        self,
        iokit: IOKitApi | None = None,
        footprint: FootprintApi | None = None,
        memsize: Callable[[], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._iokit = iokit if iokit is not None else CtypesIOKit()
        self._fp = footprint if footprint is not None else CtypesFootprint()
        self._memsize = memsize if memsize is not None else sysctl_memsize
        self._clock = clock
        self._times: dict[tuple[str, int, str | None], tuple[float, int]] = {}
        self._indices: dict[str, int] = {}

    def close(self) -> None:
        pass

    def sample(self) -> GpuSample:
        try:
            accels = self._iokit.accelerators()
        except OSError as exc:
            return GpuSample.failed(BACKEND, "backend.init", Reason.QUERY_FAILED, f"IOKit: {exc}")
        now = self._clock()
        total = self._memsize()
        adapters: list[Adapter] = []
        metrics: dict[str, DeviceMetrics] = {}
        procs: list[GpuProcess] = []
        problems: list[Problem] = []
        times: dict[tuple[str, int, str | None], tuple[float, int]] = {}
        footprints: dict[int, tuple[Reading, Reading, Reading]] = {}
        for acc in accels:
            key = acc.key
            index = self._indices.setdefault(key, len(self._indices))
            vendor = "apple" if acc.class_name.startswith("AGX") else "unknown"
            name = acc.properties.get("model")
            adapters.append(
                Adapter(index, vendor, name if isinstance(name, str) else None, None, key, BACKEND)
            )
            metrics[key] = self._metrics(acc, total)
            clients: dict[tuple[int, str | None], int | None] = {}
            bad = 0
            for props in acc.clients:
                who = parse_creator(props.get("IOUserClientCreator"))
                if who is None:
                    bad += 1
                    continue
                t = gpu_time_ns(props)
                prev = clients.get(who)
                clients[who] = t if prev is None else (prev + t if t is not None else prev)
            if bad:
                problems.append(
                    Problem(
                        "processes.iokit",
                        Reason.UNAVAILABLE,
                        f"{bad} GPU clients name no owner (IOUserClientCreator)",
                        key,
                    )
                )
            for (pid, pname), t in sorted(clients.items(), key=lambda kv: kv[0][0]):
                engines = self._rate(times, (key, pid, pname), t, now)
                if pid not in footprints:
                    footprints[pid] = self._footprint(pid)
                graphics, compressed, fp = footprints[pid]
                procs.append(
                    GpuProcess(
                        pid=pid,
                        adapter=key,
                        contexts=("metal",),
                        dedicated=graphics,
                        paged=compressed,
                        footprint=fp,
                        engines=engines,
                        name=pname,
                    )
                )
        self._times = times
        notes = ("Apple GPUs share unified memory with the CPU: footprint is not VRAM",)
        return GpuSample(
            BACKEND, tuple(adapters), metrics, tuple(procs), tuple(problems), notes=notes
        )

    def _rate(
        self,
        times: dict[tuple[str, int, str | None], tuple[float, int]],
        k: tuple[str, int, str | None],
        t: int | None,
        now: float,
    ) -> dict[str, Reading]:
        src = "iokit:AppUsage.accumulatedGPUTime (rate)"
        if t is None:
            return {"gpu_percent": Reading.missing(Reason.NOT_SUPPORTED, src, "no GPU time")}
        times[k] = (now, t)
        prev = self._times.get(k)
        if prev is None or now <= prev[0]:
            why = "a rate: needs two samples"
            return {"gpu_percent": Reading.missing(Reason.UNAVAILABLE, src, why)}
        if t < prev[1]:
            why = "GPU time went backwards (a client closed)"
            return {"gpu_percent": Reading.missing(Reason.UNAVAILABLE, src, why)}
        pct = (t - prev[1]) / 1e9 / (now - prev[0]) * 100.0
        return {"gpu_percent": Reading.measured(round(pct, 2), src)}

    def _footprint(self, pid: int) -> tuple[Reading, Reading, Reading]:
        gsrc = "task_vm_info:ledger_tag_graphics_footprint"
        csrc = "task_vm_info:ledger_tag_graphics_footprint_compressed"
        fsrc = "proc_pid_rusage:ri_phys_footprint"
        try:
            g, c = self._fp.graphics(pid)
            graphics, compressed = Reading.measured(g, gsrc), Reading.measured(c, csrc)
        except PermissionError:
            d = "needs a task port (run as root)"
            graphics = Reading.missing(Reason.DENIED, gsrc, d)
            compressed = Reading.missing(Reason.DENIED, csrc, d)
        except ProcessLookupError:
            graphics = Reading.missing(Reason.PROCESS_GONE, gsrc)
            compressed = Reading.missing(Reason.PROCESS_GONE, csrc)
        except OSError as exc:
            graphics = Reading.missing(Reason.QUERY_FAILED, gsrc, str(exc))
            compressed = Reading.missing(Reason.QUERY_FAILED, csrc, str(exc))
        try:
            fp = Reading.measured(self._fp.phys_footprint(pid), fsrc)
        except PermissionError:
            fp = Reading.missing(Reason.DENIED, fsrc, "another user's process (not root)")
        except ProcessLookupError:
            fp = Reading.missing(Reason.PROCESS_GONE, fsrc)
        except OSError as exc:
            fp = Reading.missing(Reason.QUERY_FAILED, fsrc, str(exc))
        return graphics, compressed, fp

    @staticmethod
    def _metrics(acc: Accelerator, total: int | None) -> DeviceMetrics:
        perf = acc.perf

        if perf is None:
            gone = Reading.missing(Reason.UNAVAILABLE, PERF, "IOKit gave no PerformanceStatistics")
            used = util = gone
        else:
            used = _reading(perf.get(IN_USE), f"{PERF}/{IN_USE}", IN_USE)
            util = _reading(perf.get(DEVICE_UTIL), f"{PERF}/{DEVICE_UTIL}", DEVICE_UTIL)
        tsrc = "sysctl:hw.memsize"
        total_r = (
            Reading(total, Kind.MEASURED, tsrc, detail="unified memory, shared with the CPU")
            if total is not None
            else Reading.missing(Reason.UNAVAILABLE, tsrc, "sysctl failed")
        )
        return DeviceMetrics.partial(
            "iokit",
            "not published",
            memory_total_bytes=total_r,
            memory_used_bytes=used,
            util_gpu_percent=util,
        )


# -- ctypes layers (macOS only) -------------------------------------------------------

IOKIT_PATH: Final = "/System/Library/Frameworks/IOKit.framework/IOKit"
CF_PATH: Final = "/System/Library/Frameworks/CoreFoundation.framework/CoreFoundation"
LIBSYSTEM_PATH: Final = "/usr/lib/libSystem.B.dylib"
kCFStringEncodingUTF8: Final = 0x08000100
kCFNumberSInt64Type: Final = 4
kCFNumberFloat64Type: Final = 6
RUSAGE_INFO_V0: Final = 0
TASK_VM_INFO: Final = 22


class rusage_info_v0(ctypes.Structure):
    _fields_ = (
        ("ri_uuid", ctypes.c_uint8 * 16),
        ("ri_user_time", ctypes.c_uint64),
        ("ri_system_time", ctypes.c_uint64),
        ("ri_pkg_idle_wkups", ctypes.c_uint64),
        ("ri_interrupt_wkups", ctypes.c_uint64),
        ("ri_pageins", ctypes.c_uint64),
        ("ri_wired_size", ctypes.c_uint64),
        ("ri_resident_size", ctypes.c_uint64),
        ("ri_phys_footprint", ctypes.c_uint64),
        ("ri_proc_start_abstime", ctypes.c_uint64),
        ("ri_proc_exit_abstime", ctypes.c_uint64),
    )


_VM_FIELDS = [
    "virtual_size",
    "region_count",
    "page_size",
    "resident_size",
    "resident_size_peak",
    "device",
    "device_peak",
    "internal",
    "internal_peak",
    "external",
    "external_peak",
    "reusable",
    "reusable_peak",
    "purgeable_volatile_pmap",
    "purgeable_volatile_resident",
    "purgeable_volatile_virtual",
    "compressed",
    "compressed_peak",
    "compressed_lifetime",
    "phys_footprint",
    "min_address",
    "max_address",
    "ledger_phys_footprint_peak",
    "ledger_purgeable_nonvolatile",
    "ledger_purgeable_novolatile_compressed",
    "ledger_purgeable_volatile",
    "ledger_purgeable_volatile_compressed",
    "ledger_tag_network_nonvolatile",
    "ledger_tag_network_nonvolatile_compressed",
    "ledger_tag_network_volatile",
    "ledger_tag_network_volatile_compressed",
    "ledger_tag_media_footprint",
    "ledger_tag_media_footprint_compressed",
    "ledger_tag_media_nofootprint",
    "ledger_tag_media_nofootprint_compressed",
    "ledger_tag_graphics_footprint",
    "ledger_tag_graphics_footprint_compressed",
]


# <mach/task_info.h> task_vm_info_data_t, up to the graphics ledgers (revision 3 and later)
class task_vm_info(ctypes.Structure):
    _layout_ = "ms"  # Python 3.14+ wants an explicit layout with _pack_
    _pack_ = 4  # the SDK struct is 4-byte packed (natural_t units)
    _fields_ = tuple(
        (n, ctypes.c_int32 if n in ("region_count", "page_size") else ctypes.c_uint64)
        for n in _VM_FIELDS
    )


class CtypesFootprint:
    """proc_pid_rusage and task_info(TASK_VM_INFO) from libSystem (macOS only)."""

    def __init__(self) -> None:
        self._lib: Any = None

    def _load(self) -> Any:
        if sys.platform != "darwin":
            raise OSError("footprint accounting is macOS only")
        if self._lib is None:
            self._lib = ctypes.CDLL(LIBSYSTEM_PATH, use_errno=True)
        return self._lib

    def phys_footprint(self, pid: int) -> int:
        lib = self._load()
        info = rusage_info_v0()
        if lib.proc_pid_rusage(int(pid), RUSAGE_INFO_V0, ctypes.byref(info)) != 0:
            err = ctypes.get_errno()
            raise _oserror(err, f"proc_pid_rusage({pid})")
        return int(info.ri_phys_footprint)

    def graphics(self, pid: int) -> tuple[int, int]:
        lib = self._load()
        task = ctypes.c_uint32()
        self_task = ctypes.c_uint32.in_dll(lib, "mach_task_self_")
        if lib.task_for_pid(self_task, int(pid), ctypes.byref(task)) != 0:
            raise PermissionError(f"task_for_pid({pid}) refused")
        try:
            info = task_vm_info()
            count = ctypes.c_uint32(ctypes.sizeof(info) // 4)
            kr = lib.task_info(task, TASK_VM_INFO, ctypes.byref(info), ctypes.byref(count))
            if kr != 0:
                raise OSError(f"task_info(TASK_VM_INFO) failed: {kr}")
            if count.value * 4 < task_vm_info.ledger_tag_graphics_footprint_compressed.offset + 8:
                raise OSError("this macOS has no graphics ledgers in TASK_VM_INFO")
            return (
                int(info.ledger_tag_graphics_footprint),
                int(info.ledger_tag_graphics_footprint_compressed),
            )
        finally:
            lib.mach_port_deallocate(self_task, task)


def _oserror(err: int, what: str) -> OSError:
    import errno
    import os

    if err in (errno.EPERM, errno.EACCES):
        return PermissionError(err, f"{what}: {os.strerror(err)}")
    if err == errno.ESRCH:
        return ProcessLookupError(err, f"{what}: {os.strerror(err)}")
    return OSError(err, f"{what}: {os.strerror(err) if err else 'failed'}")


def sysctl_memsize() -> int | None:
    if sys.platform != "darwin":
        return None
    try:
        lib = ctypes.CDLL(LIBSYSTEM_PATH)
        v, size = ctypes.c_uint64(), ctypes.c_size_t(8)
        if lib.sysctlbyname(b"hw.memsize", ctypes.byref(v), ctypes.byref(size), None, 0) != 0:
            return None
        return int(v.value)
    except OSError:
        return None


class CtypesIOKit:
    """IOAccelerator services and their children's properties, via IOKit + CoreFoundation."""

    def __init__(self) -> None:
        self._io: Any = None
        self._cf: Any = None

    def _load(self) -> tuple[Any, Any]:
        if sys.platform != "darwin":
            raise OSError("IOKit is macOS only")
        if self._io is None:
            io, cf = ctypes.CDLL(IOKIT_PATH), ctypes.CDLL(CF_PATH)
            vp, u32 = ctypes.c_void_p, ctypes.c_uint32
            io.IOServiceMatching.restype = vp
            io.IOServiceGetMatchingServices.argtypes = (u32, vp, ctypes.POINTER(u32))
            io.IORegistryEntryCreateCFProperties.argtypes = (u32, ctypes.POINTER(vp), vp, u32)
            io.IORegistryEntryGetChildIterator.argtypes = (
                u32,
                ctypes.c_char_p,
                ctypes.POINTER(u32),
            )
            io.IORegistryEntryGetRegistryEntryID.argtypes = (u32, ctypes.POINTER(ctypes.c_uint64))
            io.IOObjectGetClass.argtypes = (u32, ctypes.c_char_p)
            for fn in (
                "CFGetTypeID",
                "CFStringGetTypeID",
                "CFNumberGetTypeID",
                "CFBooleanGetTypeID",
                "CFDictionaryGetTypeID",
                "CFArrayGetTypeID",
                "CFDictionaryGetCount",
                "CFArrayGetCount",
            ):
                # ctypes.CDLL attribute lookup: CoreFoundation's function `fn` (cached by name)
                getattr(cf, fn).restype = ctypes.c_long
            for fn in (
                "CFGetTypeID",
                "CFDictionaryGetCount",
                "CFArrayGetCount",
                "CFRelease",
                "CFBooleanGetValue",
                "CFNumberIsFloatType",
            ):
                getattr(cf, fn).argtypes = (vp,)  # ctypes.CDLL lookup, as above
            cf.CFArrayGetValueAtIndex.restype = vp
            cf.CFArrayGetValueAtIndex.argtypes = (vp, ctypes.c_long)
            cf.CFStringGetCString.argtypes = (vp, ctypes.c_char_p, ctypes.c_long, u32)
            cf.CFNumberGetValue.argtypes = (vp, ctypes.c_long, vp)
            cf.CFDictionaryGetKeysAndValues.argtypes = (vp, vp, vp)
            self._io, self._cf = io, cf
        return self._io, self._cf

    def accelerators(self) -> list[Accelerator]:
        io, _ = self._load()
        it = ctypes.c_uint32()
        if io.IOServiceGetMatchingServices(
            0, io.IOServiceMatching(b"IOAccelerator"), ctypes.byref(it)
        ):
            raise OSError("IOServiceGetMatchingServices(IOAccelerator) failed")
        out = []
        try:
            while entry := io.IOIteratorNext(it):
                try:
                    out.append(self._accelerator(entry))
                finally:
                    io.IOObjectRelease(entry)
        finally:
            io.IOObjectRelease(it)
        return out

    def _accelerator(self, entry: int) -> Accelerator:
        io, _ = self._load()
        rid, cls = ctypes.c_uint64(), ctypes.create_string_buffer(128)
        io.IORegistryEntryGetRegistryEntryID(entry, ctypes.byref(rid))
        io.IOObjectGetClass(entry, cls)
        clients = []
        kids = ctypes.c_uint32()
        if io.IORegistryEntryGetChildIterator(entry, b"IOService", ctypes.byref(kids)) == 0:
            try:
                while child := io.IOIteratorNext(kids):
                    try:
                        clients.append(self._properties(child))
                    finally:
                        io.IOObjectRelease(child)
            finally:
                io.IOObjectRelease(kids)
        return Accelerator(
            int(rid.value), cls.value.decode(errors="replace"), self._properties(entry), clients
        )

    def _properties(self, entry: int) -> dict[str, Any]:
        io, cf = self._load()
        ref = ctypes.c_void_p()
        if io.IORegistryEntryCreateCFProperties(entry, ctypes.byref(ref), None, 0) != 0 or not ref:
            return {}
        try:
            value = self._py(ref.value, 0)
            return value if isinstance(value, dict) else {}
        finally:
            cf.CFRelease(ref)

    def _py(self, ref: int | None, depth: int) -> Any:
        """A CoreFoundation value as Python (strings, numbers, bools, dicts, arrays)."""
        cf = self._cf
        if not ref or depth > 8:
            return None
        t = cf.CFGetTypeID(ref)
        if t == cf.CFStringGetTypeID():
            buf = ctypes.create_string_buffer(1024)
            ok = cf.CFStringGetCString(ref, buf, 1024, kCFStringEncodingUTF8)
            return buf.value.decode("utf-8", "replace") if ok else None
        if t == cf.CFBooleanGetTypeID():
            return bool(cf.CFBooleanGetValue(ref))
        if t == cf.CFNumberGetTypeID():
            if cf.CFNumberIsFloatType(ref):
                d = ctypes.c_double()
                cf.CFNumberGetValue(ref, kCFNumberFloat64Type, ctypes.byref(d))
                return d.value
            i = ctypes.c_int64()
            cf.CFNumberGetValue(ref, kCFNumberSInt64Type, ctypes.byref(i))
            return i.value
        if t == cf.CFArrayGetTypeID():
            return [
                self._py(cf.CFArrayGetValueAtIndex(ref, n), depth + 1)
                for n in range(cf.CFArrayGetCount(ref))
            ]
        if t == cf.CFDictionaryGetTypeID():
            n = cf.CFDictionaryGetCount(ref)
            keys, vals = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)()
            cf.CFDictionaryGetKeysAndValues(ref, keys, vals)
            out = {}
            for k, v in zip(keys, vals, strict=True):
                name = self._py(k, depth + 1)
                if isinstance(name, str):
                    out[name] = self._py(v, depth + 1)
            return out
        return None  # CFData and others: not needed
