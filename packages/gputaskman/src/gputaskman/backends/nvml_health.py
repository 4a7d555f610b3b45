"""NVML health readings of each GPU, once per refresh: critical XID events, ECC counts, retired
pages, remapped rows, clock event (throttle) reasons, fan speed and PCIe / NVLink rates, keyed
as `gpuhealth.HEALTH_FIELDS` lists them; each a `Reading`, missing with the reason where the GPU
or driver has no such counter.

Theory of operation
-------------------
* **XID events.** One event set (``nvmlEventSetCreate``) for the backend's life; each GPU is
  registered for ``nvmlEventTypeXidCriticalError`` (``nvmlDeviceRegisterEvents``) the first
  time it is seen, and each refresh drains what is pending with ``nvmlEventSetWait(set, 0)``:
  a timeout of 0 answers at once (NVML_ERROR_TIMEOUT when nothing is pending), so a refresh
  never waits, and at most `MAX_EVENTS` are taken per refresh (the rest wait for the next).
  An event's GPU is found by its PCI bus id (``nvmlDeviceGetPciInfo`` on the event's handle,
  asked only when an event arrives). Counts run from the GPU's registration: the refresh
  that registers it has no count yet (missing, "watching began with this sample"), which is
  what ``--once`` and ``--json`` show; `serve` and the TUI count from their start.
* **Counters.** One ``nvmlDeviceGetFieldValues`` call per GPU reads `COUNTERS` and `RATES`
  (15 fields), each with its own return code, so each reading is missing with its own reason
  (the retired-page fields on a GPU that remaps rows, ECC on a GPU without it). PCIe and
  NVLink are counters turned into rates over two refreshes with NVML's own timestamps: the
  first refresh has none, nor has one where a counter went backwards (wrapped or reset).
  ``nvmlDeviceGetPcieThroughput`` is not used: it samples for 20 ms per call, in the refresh.
* **Clock event reasons** from ``nvmlDeviceGetCurrentClocksEventReasons`` (driver 535 and
  later), else ``nvmlDeviceGetCurrentClocksThrottleReasons``; **fan** from
  ``nvmlDeviceGetFanSpeed`` (percent of the maximum, the first fan).
* **Stay cheap.** A call a GPU answered "not supported" (or "function not found") is not asked
  of that GPU again, nor is a field it answered so (the call asks for the others only, and
  not at all when none is left): their readings keep that reason.

Look, don't touch: only Get and Wait calls, and an event set this process owns; nothing that
changes or clears a GPU setting or counter is ever called. Not validated on hardware: the
paths are exercised through a mocked NVML (tests/test_nvml_health.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from gputaskman.backends.nvml_calls import (
    Lost,
    call,
    detail_of,
    is_error,
    missing_for,
    normalise_bus_id,
    number,
    reason_for,
    text_of,
)
from gputaskman.base.gpuhealth import HEALTH_FIELDS
from gputaskman.base.readings import Problem, Reading, Reason

EVENT_XID = 0x8  # nvmlEventTypeXidCriticalError
MAX_EVENTS = 64  # events taken per refresh; the rest wait for the next
ALL_LINKS = 2**32 - 1  # scope UINT_MAX: NVLink throughput summed over every link
FIELDS_API = "nvmlDeviceGetFieldValues"
WAIT_API = "nvmlEventSetWait"
REGISTER_API = "nvmlDeviceRegisterEvents"
FAN_API = "nvmlDeviceGetFanSpeed"

# key -> (NVML field name, field id); the value is a count or a 0/1 flag
COUNTERS: tuple[tuple[str, str, int], ...] = (
    ("ecc_volatile_corrected_errors", "NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 3),
    ("ecc_volatile_uncorrected_errors", "NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 4),
    ("ecc_aggregate_corrected_errors", "NVML_FI_DEV_ECC_SBE_AGG_TOTAL", 5),
    ("ecc_aggregate_uncorrected_errors", "NVML_FI_DEV_ECC_DBE_AGG_TOTAL", 6),
    ("retired_pages_single_bit", "NVML_FI_DEV_RETIRED_SBE", 29),
    ("retired_pages_double_bit", "NVML_FI_DEV_RETIRED_DBE", 30),
    ("retired_pages_pending", "NVML_FI_DEV_RETIRED_PENDING", 31),
    ("remapped_rows_correctable", "NVML_FI_DEV_REMAPPED_COR", 142),
    ("remapped_rows_uncorrectable", "NVML_FI_DEV_REMAPPED_UNC", 143),
    ("remapped_rows_pending", "NVML_FI_DEV_REMAPPED_PENDING", 144),
    ("remapped_rows_failure", "NVML_FI_DEV_REMAPPED_FAILURE", 145),
)
# key -> (NVML field name, field id, scope or None, bytes per counter unit)
RATES: tuple[tuple[str, str, int, int | None, int], ...] = (
    ("pcie_tx_bytes_per_second", "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197, None, 1),
    ("pcie_rx_bytes_per_second", "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198, None, 1),
    ("nvlink_tx_bytes_per_second", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138, ALL_LINKS, 1024),
    ("nvlink_rx_bytes_per_second", "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139, ALL_LINKS, 1024),
)
REQUEST: list[int | tuple[int, int]] = [fid for _k, _n, fid in COUNTERS] + [
    fid if scope is None else (fid, scope) for _k, _n, fid, scope, _u in RATES
]
# nvmlValueType_t -> the member of nvmlValue_t that holds the value
_UNION = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
XID_FIELDS = ("xid_critical_errors", "xid_last", "xid_watched_seconds")


def _source(field: str) -> str:
    return f"{FIELDS_API}({field})"


class NvmlHealth:
    """The health readings of an `NvmlBackend`'s GPUs; `lib` is its pynvml (or a mock), `clock`
    the wall clock (seconds) for how long XID events have been watched."""

    def __init__(self, lib: Any, clock: Callable[[], float] = time.time) -> None:
        self._lib = lib
        self._clock = clock
        self._set: Any = None
        self._no_set: Reading | None = None  # why there is no event set
        self._since: dict[str, float] = {}  # bus -> when its registration succeeded
        self._unwatched: dict[str, Reading] = {}  # bus -> why its registration failed
        self._fresh: set[str] = set()  # registered in this refresh
        self._xids: dict[str, int] = {}
        self._last: dict[str, int] = {}
        self._unsupported: dict[tuple[str, str], Reading] = {}  # (bus, api) -> its answer
        self._dead_fields: dict[str, dict[int, Reading]] = {}  # bus -> unsupported fields
        self._prev: dict[tuple[str, str], tuple[int, float]] = {}  # counter, seconds

    # -- XID events

    def begin(self) -> None:
        """A refresh starts (GPUs registered before it now have counts)."""
        self._fresh.clear()

    def _event_set(self) -> Any:
        if self._set is None and self._no_set is None:
            try:
                self._set = self._lib.nvmlEventSetCreate()
            except Exception as exc:
                self._no_set = missing_for(exc, "nvmlEventSetCreate")
        return self._set

    def watch(self, handle: Any, bus: str) -> None:
        """Register `bus` for critical XID events, once (a lost GPU is tried again)."""
        if bus in self._since or bus in self._unwatched:
            return
        es = self._event_set()
        if es is None:
            assert self._no_set is not None
            self._unwatched[bus] = self._no_set
            return
        try:
            self._lib.nvmlDeviceRegisterEvents(handle, EVENT_XID, es)
        except Exception as exc:
            if reason_for(exc) is not Reason.GPU_LOST:
                self._unwatched[bus] = missing_for(exc, REGISTER_API)
            return
        self._since[bus] = self._clock()
        self._fresh.add(bus)
        self._xids.setdefault(bus, 0)

    def drain(self) -> list[Problem]:
        """Take the pending events (at most `MAX_EVENTS`) without waiting; what went wrong."""
        if self._set is None:
            return []
        lib, problems = self._lib, []
        for _ in range(MAX_EVENTS):
            try:
                data = lib.nvmlEventSetWait(self._set, 0)
            except Exception as exc:
                if not is_error(exc, "Timeout"):  # a timeout: nothing pending
                    problems.append(Problem("health.xid", reason_for(exc), detail_of(exc)))
                break
            if not int(data.eventType) & EVENT_XID:
                continue
            try:
                bus = normalise_bus_id(text_of(lib.nvmlDeviceGetPciInfo(data.device).busId) or "")
            except Exception as exc:
                why = f"an XID {int(data.eventData)} event of a GPU NVML could not name: "
                problems.append(Problem("health.xid", reason_for(exc), why + detail_of(exc)))
                continue
            self._xids[bus] = self._xids.get(bus, 0) + 1
            self._last[bus] = int(data.eventData)
        return problems

    def xid(self, bus: str) -> dict[str, Reading]:
        """The XID readings of `bus` after `drain`."""
        if bus in self._unwatched:
            return dict.fromkeys(XID_FIELDS, self._unwatched[bus])
        since = self._since.get(bus)
        if since is None or bus in self._fresh:
            why = "watching began with this sample: counts come from the next refresh"
            if since is None:
                why = "not registered for XID events (the GPU was lost when asked)"
            r = Reading.missing(Reason.UNAVAILABLE, f"nvml:{REGISTER_API}", why)
            return dict.fromkeys(XID_FIELDS, r)
        src = f"nvml:{WAIT_API}(nvmlEventTypeXidCriticalError)"
        last = self._last.get(bus)
        return {
            "xid_critical_errors": Reading.measured(self._xids.get(bus, 0), src),
            "xid_last": Reading.measured(last, src)
            if last is not None
            else Reading.missing(Reason.UNAVAILABLE, src, "no critical XID since watching began"),
            "xid_watched_seconds": Reading.measured(
                round(max(0.0, self._clock() - since), 1), f"nvml:{REGISTER_API}"
            ),
        }

    # -- counters

    def _sticky(self, bus: str, api: str, fn: Callable[[], Any]) -> tuple[Any, Reading | None]:
        """`call`, except that an API the GPU does not support is asked once."""
        known = self._unsupported.get((bus, api))
        if known is not None:
            return None, known
        value, missing = call(fn, api)
        if missing is not None and missing.reason is Reason.NOT_SUPPORTED:
            self._unsupported[(bus, api)] = missing
        return value, missing

    def counters(self, h: Any, bus: str) -> dict[str, Reading]:
        """Every health reading of GPU `h` but the XID ones (a lost GPU raises `Lost`)."""
        lib = self._lib
        out: dict[str, Reading] = {}
        dead = self._dead_fields.setdefault(bus, {})  # field index -> its "not supported"
        want = [i for i in range(len(REQUEST)) if i not in dead]
        values, missing = (None, None)
        if want:
            ask = [REQUEST[i] for i in want]
            values, missing = self._sticky(
                bus, FIELDS_API, lambda: lib.nvmlDeviceGetFieldValues(h, ask)
            )
        fields = dict(zip(want, values, strict=True)) if values is not None else {}
        for i, (key, name, *_rest) in enumerate(COUNTERS + RATES):  # type: ignore[operator]
            got = dead.get(i) or missing or self._field(fields[i], _source(name))
            if got.reason is Reason.NOT_SUPPORTED and missing is None:
                dead[i] = got  # this GPU has no such counter: not asked again
            if got.value is not None and i >= len(COUNTERS):
                got = self._rate(bus, key, got, fields[i].timestamp, RATES[i - len(COUNTERS)][4])
            out[key] = got
        api = "nvmlDeviceGetCurrentClocksEventReasons"
        got, missing = self._sticky(bus, api, lambda: self._clock_reasons(h))
        out["clocks_event_reasons"] = missing or number(got[1], got[0])
        fan, missing = self._sticky(bus, FAN_API, lambda: lib.nvmlDeviceGetFanSpeed(h))
        out["fan_speed_percent"] = missing or number(fan, FAN_API)
        return {k: out[k] for k in HEALTH_FIELDS if k in out}

    def _clock_reasons(self, h: Any) -> tuple[str, Any]:
        try:
            return "nvmlDeviceGetCurrentClocksEventReasons", (
                self._lib.nvmlDeviceGetCurrentClocksEventReasons(h)
            )
        except Exception as exc:  # drivers before 535 know the older name only
            if not (is_error(exc, "FunctionNotFound") or isinstance(exc, AttributeError)):
                raise
        api = "nvmlDeviceGetCurrentClocksThrottleReasons"
        return api, self._lib.nvmlDeviceGetCurrentClocksThrottleReasons(h)

    def _field(self, fv: Any, api: str) -> Reading:
        """One field value as a reading: its own return code decides."""
        code = int(fv.nvmlReturn)
        if code != 0:
            maker = getattr(self._lib, "NVMLError", None)
            if maker is None:
                return Reading.missing(Reason.QUERY_FAILED, f"nvml:{api}", f"NVML return {code}")
            exc = maker(code)
            if reason_for(exc) is Reason.GPU_LOST:
                raise Lost(detail_of(exc))
            return missing_for(exc, api)
        member = _UNION.get(int(fv.valueType))
        if member is None:
            why = f"unknown value type {int(fv.valueType)}"
            return Reading.missing(Reason.QUERY_FAILED, f"nvml:{api}", why)
        v = getattr(fv.value, member)
        if v is not None and v < 0:
            return Reading.missing(Reason.QUERY_FAILED, f"nvml:{api}", f"negative count {v}")
        return number(v, api)

    def _rate(self, bus: str, key: str, counter: Reading, ts_us: int, unit: int) -> Reading:
        """Bytes per second from `counter` (read at NVML's `ts_us`, µs; 0: not given) and
        the one this GPU gave last refresh."""
        assert counter.value is not None
        now = int(ts_us) / 1e6 if int(ts_us) > 0 else self._clock()
        raw = int(counter.value)
        prev = self._prev.get((bus, key))
        self._prev[(bus, key)] = (raw, now)
        src = f"{counter.source} delta"
        if prev is None:
            return Reading.missing(Reason.UNAVAILABLE, src, "a rate needs two samples")
        if raw < prev[0] or now <= prev[1]:
            why = "the counter went backwards (wrapped or reset)" if raw < prev[0] else "no time"
            return Reading.missing(Reason.UNAVAILABLE, src, why)
        return Reading.measured(round((raw - prev[0]) * unit / (now - prev[1])), src)

    def close(self) -> None:
        """Free the event set (a broken driver must not raise here)."""
        if self._set is not None:
            with contextlib.suppress(Exception):  # a broken driver must not raise here
                self._lib.nvmlEventSetFree(self._set)
        self._set = None
