"""Windows GPU performance counters (PDH): per-process memory and engine use, per adapter.

Theory of operation
-------------------
Four counter sets, all with wildcard instances, read once per refresh:

* ``\\GPU Process Memory(*)\\Local Usage``: bytes of the adapter's local (video) memory a
  process holds. This is the per-process VRAM figure. ``Dedicated Usage`` is never read:
  it charges a shared surface to every process that opened it (dwm.exe, csrss.exe and the
  app that made it), so its per-process values overcount and do not add up.
* ``\\GPU Process Memory(*)\\Non Local Usage``: bytes of system memory the GPU has mapped
  for the process (the "Paged" column). Never added to VRAM.
* ``\\GPU Engine(*)\\Utilization Percentage``: per process, per engine. A rate counter:
  the first collection has no value, which is "needs two samples", never 0.
* ``\\GPU Adapter Memory(*)\\Dedicated Usage`` (and ``Shared Usage``): the adapter's own
  total, the reference the per-process sum is compared with.

Instance names carry the identity: ``pid_1234_luid_0x00000000_0x0000D1A2_phys_0`` for
process memory, ``..._eng_0_engtype_3D`` for engines, ``luid_..._phys_0`` for adapters.
`parse_instance` reads them tolerantly (any case, any engtype text, spaces, a ``#n``
duplicate suffix); a name it cannot read is counted in `PdhView.unparsed`, not guessed.

`aggregate` is sans-io: it turns one read (`CounterRead` per counter path) into a `PdhView`
keyed by LUID (the same `dxgi.luid_key` spelling). `PdhApi` is the I/O seam; `CtypesPdh`
is the real one (pdh.dll by absolute path, PdhAddEnglishCounterW so a localized Windows
still finds the counters). Not validated on Windows hardware; tests use recorded counter
names and values.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from gputaskman.base.gpusource import GpuProcess
from gputaskman.base.readings import Reading, Reason

LOCAL: Final = r"\GPU Process Memory(*)\Local Usage"
NON_LOCAL: Final = r"\GPU Process Memory(*)\Non Local Usage"
ENGINE: Final = r"\GPU Engine(*)\Utilization Percentage"
ADAPTER_DEDICATED: Final = r"\GPU Adapter Memory(*)\Dedicated Usage"
ADAPTER_SHARED: Final = r"\GPU Adapter Memory(*)\Shared Usage"
COUNTERS: Final = (LOCAL, NON_LOCAL, ENGINE, ADAPTER_DEDICATED, ADAPTER_SHARED)
# Machine-wide counters for the host panel (hostplat.py), one instance each.
MEMORY_AVAILABLE: Final = r"\Memory\Available Bytes"
PROCESSOR_TIME: Final = r"\Processor(_Total)\% Processor Time"
HOST_COUNTERS: Final = (MEMORY_AVAILABLE, PROCESSOR_TIME)
# Rates: formatted as doubles, and their first collection has no value yet.
RATES: Final = (ENGINE, PROCESSOR_TIME)
#: Never queried: see the module docstring. Kept so tests can assert it is never asked for.
FORBIDDEN: Final = (r"\GPU Process Memory(*)\Dedicated Usage",)

PDH_CSTATUS_VALID_DATA: Final = 0x0
PDH_CSTATUS_NEW_DATA: Final = 0x1
PDH_MORE_DATA: Final = 0x800007D2
PDH_NO_DATA: Final = 0x800007D5
PDH_INVALID_DATA: Final = 0xC0000BC6
PDH_CSTATUS_NO_OBJECT: Final = 0xC0000BB8
PDH_CSTATUS_NO_COUNTER: Final = 0xC0000BB9
PDH_CSTATUS_NO_INSTANCE: Final = 0x800007D1
PDH_FMT_DOUBLE: Final = 0x200
PDH_FMT_LARGE: Final = 0x400
PDH_FMT_NOCAP100: Final = 0x8000

_INSTANCE = re.compile(
    r"^(?:pid_(?P<pid>\d+)_)?"
    r"luid_(?P<hi>0x[0-9a-f]{1,8})_(?P<lo>0x[0-9a-f]{1,8})"
    r"(?:_phys_(?P<phys>\d+))?"
    r"(?:_eng_(?P<eng>\d+))?"
    r"(?:_engtype_(?P<engtype>.*?))?"
    r"(?:#\d+)?$",
    re.IGNORECASE | re.DOTALL,
)


@dataclass(frozen=True, slots=True)
class Instance:
    """A parsed counter instance name."""

    luid: str
    pid: int | None = None
    phys: int | None = None
    eng: int | None = None
    engtype: str | None = None


@functools.lru_cache(maxsize=65536)
def parse_instance(name: str) -> Instance | None:
    """Identity from a GPU counter instance name, or None when it is not one.

    Cached: the same instance names come back every refresh (the result is immutable)."""
    m = _INSTANCE.match(name.strip())
    if m is None:
        return None
    hi, lo = int(m["hi"], 16), int(m["lo"], 16)
    engtype = m["engtype"]
    if engtype is not None:
        engtype = engtype.strip() or None
    return Instance(
        luid=f"luid_0x{hi:08x}_0x{lo:08x}",
        pid=int(m["pid"]) if m["pid"] is not None else None,
        phys=int(m["phys"]) if m["phys"] is not None else None,
        eng=int(m["eng"]) if m["eng"] is not None else None,
        engtype=engtype,
    )


@functools.lru_cache(maxsize=1024)
def engine_name(engtype: str) -> str:
    """Engine type as a reading key: ``3D`` -> ``3d_percent``, ``VideoDecode`` ->
    ``videodecode_percent``, ``Compute_0`` -> ``compute_0_percent``."""
    key = re.sub(r"[^0-9a-z]+", "_", engtype.lower()).strip("_") or "unknown"
    return f"{key}_percent"


@dataclass(frozen=True, slots=True)
class CounterRead:
    """One wildcard counter read: instance -> value, or why there is none."""

    values: Mapping[str, float] | None
    status: int = 0
    detail: str | None = None

    @classmethod
    def ok(cls, values: Mapping[str, float]) -> CounterRead:
        return cls(dict(values))

    @classmethod
    def failed(cls, status: int, detail: str | None = None) -> CounterRead:
        return cls(None, status, detail)


def reason_for_status(status: int) -> Reason:
    """The one place a PDH status becomes a Reason."""
    status &= 0xFFFFFFFF
    if status in (PDH_CSTATUS_NO_OBJECT, PDH_CSTATUS_NO_COUNTER):
        return Reason.NOT_SUPPORTED  # this Windows has no GPU counters (before 10 1709)
    if status in (PDH_INVALID_DATA, PDH_NO_DATA, PDH_CSTATUS_NO_INSTANCE):
        return Reason.UNAVAILABLE
    return Reason.QUERY_FAILED


@dataclass(slots=True)
class ProcCounters:
    """One process on one adapter (LUID)."""

    local: Reading
    non_local: Reading
    engines: dict[str, Reading] = field(default_factory=dict)


def process_row(pid: int, luid: str, c: ProcCounters, **more: Any) -> GpuProcess:
    """One process on one adapter from its PDH counters: dedicated (local) and shared
    (non-local) memory and its engines; `more` adds what the caller knows (name, host)."""
    return GpuProcess(
        pid=pid,
        adapter=luid,
        contexts=("wddm",),
        dedicated=c.local,
        paged=c.non_local,
        engines=c.engines,
        **more,
    )


@dataclass(slots=True)
class AdapterCounters:
    dedicated_usage: Reading
    shared_usage: Reading
    util_percent: Reading
    engines: dict[str, Reading] = field(default_factory=dict)


@dataclass(slots=True)
class PdhView:
    """Counters of one refresh, keyed by LUID (and pid)."""

    adapters: dict[str, AdapterCounters] = field(default_factory=dict)
    processes: dict[tuple[int, str], ProcCounters] = field(default_factory=dict)
    failures: dict[str, Reading] = field(default_factory=dict)  # counter path -> why
    unparsed: int = 0
    bad_values: int = 0


def _src(path: str) -> str:
    return "pdh:" + path.replace("(*)", "")


def _missing_for(read: CounterRead | None, path: str) -> Reading | None:
    if read is None:
        return Reading.missing(Reason.UNAVAILABLE, _src(path), "counter not read")
    if read.values is None:
        detail = read.detail or f"PDH status 0x{read.status & 0xFFFFFFFF:08X}"
        if path in RATES and (read.status & 0xFFFFFFFF) in (PDH_INVALID_DATA, PDH_NO_DATA):
            detail = "a rate: needs two samples"
        return Reading.missing(reason_for_status(read.status), _src(path), detail)
    return None


def machine_reading(read: CounterRead | None, path: str) -> Reading:
    """A machine-wide counter (one instance, such as `MEMORY_AVAILABLE`) as a reading:
    measured, or missing with the reason PDH gave."""
    missing = _missing_for(read, path)
    if missing is not None:
        return missing
    assert read is not None and read.values is not None
    values = [v for v in read.values.values() if math.isfinite(v) and v >= 0]
    if len(values) != 1:
        return Reading.missing(
            Reason.QUERY_FAILED,
            _src(path),
            f"{len(read.values)} instances, expected one valid value",
        )
    return Reading.measured(values[0], _src(path))


def _values(read: CounterRead | None, view: PdhView) -> list[tuple[Instance, float]]:
    out: list[tuple[Instance, float]] = []
    if read is None or read.values is None:
        return out
    for name, value in read.values.items():
        if name.strip().lower() == "_total":
            continue  # an aggregate instance some counter sets publish: not a GPU or process
        inst = parse_instance(name)
        if inst is None:
            view.unparsed += 1
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            view.bad_values += 1
            continue
        if not math.isfinite(value) or value < 0:
            view.bad_values += 1
            continue
        out.append((inst, value))
    return out


def aggregate(reads: Mapping[str, CounterRead]) -> PdhView:
    """One `PdhView` from one read of `COUNTERS`. Pure: no I/O."""
    view = PdhView()
    for path in COUNTERS:
        why = _missing_for(reads.get(path), path)
        if why is not None:
            view.failures[path] = why

    # Memory, per (pid, luid); several "phys" instances of one process add up.
    mem: dict[str, dict[tuple[int, str], int]] = {LOCAL: {}, NON_LOCAL: {}}
    for path in (LOCAL, NON_LOCAL):
        for inst, value in _values(reads.get(path), view):
            if inst.pid is None:
                continue
            key = (inst.pid, inst.luid)
            mem[path][key] = mem[path].get(key, 0) + int(value)

    # Engines: per (pid, luid, phys, eng). Per process, an engine type reads the busiest
    # engine of that type; per adapter, an engine is the sum over processes, and the
    # adapter's utilisation is its busiest engine (Task Manager's rule).
    per_proc: dict[tuple[int, str], dict[str, float]] = {}
    per_engine: dict[tuple[str, int | None, int | None], tuple[str, float]] = {}
    for inst, value in _values(reads.get(ENGINE), view):
        if inst.pid is None or inst.engtype is None:
            view.unparsed += 1
            continue
        name = engine_name(inst.engtype)
        e = per_proc.setdefault((inst.pid, inst.luid), {})
        e[name] = max(e.get(name, 0.0), value)
        ek = (inst.luid, inst.phys, inst.eng)
        prev = per_engine.get(ek, (name, 0.0))
        per_engine[ek] = (name, prev[1] + value)

    engine_fail = view.failures.get(ENGINE)
    esrc = _src(ENGINE)
    for key in set(mem[LOCAL]) | set(mem[NON_LOCAL]) | set(per_proc):
        pc = ProcCounters(
            local=_mem_reading(mem[LOCAL], key, view.failures.get(LOCAL), LOCAL),
            non_local=_mem_reading(mem[NON_LOCAL], key, view.failures.get(NON_LOCAL), NON_LOCAL),
        )
        if engine_fail is not None:
            pc.engines["gpu_percent"] = engine_fail
        elif key in per_proc:
            pc.engines = {k: Reading.measured(round(v, 2), esrc) for k, v in per_proc[key].items()}
            pc.engines["gpu_percent"] = Reading.measured(
                round(max(per_proc[key].values()), 2), esrc
            )
        else:
            pc.engines["gpu_percent"] = Reading.missing(
                Reason.NOT_LISTED, esrc, "no engine instance for this process"
            )
        view.processes[key] = pc

    luids = {i.luid for i, _ in _values(reads.get(ADAPTER_DEDICATED), PdhView())}
    luids |= {k[1] for k in view.processes} | {k[0] for k in per_engine}
    dedicated = _adapter_sums(reads.get(ADAPTER_DEDICATED), view)
    shared = _adapter_sums(reads.get(ADAPTER_SHARED), view)
    for luid in sorted(luids):
        engines: dict[str, float] = {}
        for (l_, _, _), (name, total) in per_engine.items():
            if l_ == luid:
                engines[name] = max(engines.get(name, 0.0), total)
        if engine_fail is not None:
            util: Reading = engine_fail
        elif engines:
            util = Reading.measured(round(max(engines.values()), 2), esrc + " (busiest engine)")
        else:
            util = Reading.missing(Reason.UNAVAILABLE, esrc, "no engine instance on this adapter")
        view.adapters[luid] = AdapterCounters(
            dedicated_usage=_mem_reading(
                dedicated, luid, view.failures.get(ADAPTER_DEDICATED), ADAPTER_DEDICATED
            ),
            shared_usage=_mem_reading(
                shared, luid, view.failures.get(ADAPTER_SHARED), ADAPTER_SHARED
            ),
            util_percent=util,
            engines={k: Reading.measured(round(v, 2), esrc) for k, v in engines.items()},
        )
    return view


def _adapter_sums(read: CounterRead | None, view: PdhView) -> dict[str, int]:
    out: dict[str, int] = {}
    for inst, value in _values(read, view):
        if inst.pid is None:
            out[inst.luid] = out.get(inst.luid, 0) + int(value)
    return out


def _mem_reading(
    values: Mapping[Any, int], key: Any, failure: Reading | None, path: str
) -> Reading:
    if failure is not None:
        return failure
    if key in values:
        return Reading.measured(values[key], _src(path))
    return Reading.missing(Reason.NOT_LISTED, _src(path), "no instance for this process/adapter")


class PdhApi(Protocol):
    """Reads wildcard counters; the query (and rate state) lives across calls."""

    def read(self, paths: Sequence[str]) -> dict[str, CounterRead]: ...

    def close(self) -> None: ...


class PDH_FMT_COUNTERVALUE(ctypes.Structure):
    class _U(ctypes.Union):
        _fields_ = (
            ("longValue", ctypes.c_long),
            ("doubleValue", ctypes.c_double),
            ("largeValue", ctypes.c_longlong),
            ("pointer", ctypes.c_void_p),
        )

    _fields_ = (("CStatus", ctypes.c_uint32), ("u", _U))


class PDH_FMT_COUNTERVALUE_ITEM_W(ctypes.Structure):
    _fields_ = (("szName", ctypes.c_void_p), ("FmtValue", PDH_FMT_COUNTERVALUE))


class CtypesPdh:
    """PDH through ctypes (Windows only). One query; counters added on first read."""

    def __init__(self) -> None:
        self._dll: Any = None
        self._query = ctypes.c_void_p()
        self._counters: dict[str, ctypes.c_void_p | CounterRead] = {}

    def _load(self) -> Any:
        if self._dll is None:
            if sys.platform != "win32":
                raise OSError("PDH exists only on Windows")
            from gputaskman.backends.win import _windows_system_directory, system_dll

            path = system_dll("pdh.dll", get_system_directory=_windows_system_directory)
            self._dll = ctypes.WinDLL(path)  # type: ignore[attr-defined]
            status = self._dll.PdhOpenQueryW(None, None, ctypes.byref(self._query)) & 0xFFFFFFFF
            if status != 0:
                self._dll = None
                raise OSError(f"PdhOpenQueryW failed: 0x{status:08X}")
        return self._dll

    def read(self, paths: Sequence[str]) -> dict[str, CounterRead]:
        dll = self._load()
        for p in paths:
            if p in self._counters:
                continue
            h = ctypes.c_void_p()
            status = (
                dll.PdhAddEnglishCounterW(self._query, ctypes.c_wchar_p(p), None, ctypes.byref(h))
                & 0xFFFFFFFF
            )
            self._counters[p] = (
                h
                if status == 0
                else CounterRead.failed(status, f"PdhAddEnglishCounterW: 0x{status:08X}")
            )
        status = dll.PdhCollectQueryData(self._query) & 0xFFFFFFFF
        out: dict[str, CounterRead] = {}
        for p in paths:
            handle = self._counters[p]
            if isinstance(handle, CounterRead):
                out[p] = handle
            elif status != 0:
                out[p] = CounterRead.failed(status, f"PdhCollectQueryData: 0x{status:08X}")
            else:
                out[p] = self._array(dll, handle, p in RATES)
        return out

    def _array(self, dll: Any, h: ctypes.c_void_p, percent: bool) -> CounterRead:
        fmt = (PDH_FMT_DOUBLE | PDH_FMT_NOCAP100) if percent else PDH_FMT_LARGE
        size, count = ctypes.c_uint32(0), ctypes.c_uint32(0)
        status = (
            dll.PdhGetFormattedCounterArrayW(h, fmt, ctypes.byref(size), ctypes.byref(count), None)
            & 0xFFFFFFFF
        )
        if status not in (PDH_MORE_DATA, 0):
            return CounterRead.failed(status)
        if size.value == 0:
            return CounterRead.ok({})
        buf = (ctypes.c_byte * size.value)()
        status = (
            dll.PdhGetFormattedCounterArrayW(h, fmt, ctypes.byref(size), ctypes.byref(count), buf)
            & 0xFFFFFFFF
        )
        if status != 0:
            return CounterRead.failed(status)
        items = ctypes.cast(buf, ctypes.POINTER(PDH_FMT_COUNTERVALUE_ITEM_W))
        values: dict[str, float] = {}
        invalid = 0
        for i in range(count.value):
            it = items[i]
            if it.FmtValue.CStatus not in (PDH_CSTATUS_VALID_DATA, PDH_CSTATUS_NEW_DATA):
                invalid += 1  # this instance has no valid value now; absent, not 0
                continue
            name = ctypes.wstring_at(it.szName)
            v = it.FmtValue.u.doubleValue if percent else it.FmtValue.u.largeValue
            values[name] = values.get(name, 0) + v  # duplicate names: same instance, summed
        if not values and invalid:
            # a rate counter's first collection: no instance has a value yet
            return CounterRead.failed(PDH_INVALID_DATA, "a rate: needs two samples")
        return CounterRead.ok(values)

    def close(self) -> None:
        if self._dll is not None:
            self._dll.PdhCloseQuery(self._query)
            self._dll = None
            self._counters.clear()
