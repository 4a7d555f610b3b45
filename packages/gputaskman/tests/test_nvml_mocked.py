"""NVML paths through mocked NVML responses (this machine has no NVIDIA GPU or driver).

`MockedNvml` stands in for the `pynvml` module: it answers the calls nvml.py makes with
responses shaped like pynvml's (objects with the same attribute names, the same
NVML_VALUE_NOT_AVAILABLE sentinel, `None` for hidden per-process memory) and raises the
real `pynvml.NVMLError_*` classes, so the error map is tested against the binding's own
exception hierarchy. Only the test of a missing library uses the real binding.
"""

from __future__ import annotations

import ctypes.util
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from gputaskman.backends.nvml import NOT_AVAILABLE_UINT, NOT_AVAILABLE_ULL, NvmlBackend, reason_for
from gputaskman.base import schema
from gputaskman.base.readings import Kind, Reason
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner

GIB = 1024**3
BUS_A = "00000000:01:00.0"
BUS_B = "00000000:41:00.0"


def err(code: int) -> Exception:
    return pynvml.NVMLError(code)


def proc(pid: int, used: int | None) -> SimpleNamespace:
    return SimpleNamespace(
        pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
    )


def device(bus: str, name: str = "NVIDIA Mock GPU", **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "bus": bus.upper(),  # NVML reports upper-case hex; we normalise
        "name": name.encode(),  # older bindings return bytes
        "uuid": f"GPU-{bus[-7:-5]}",
        "memory": SimpleNamespace(
            total=16 * GIB, reserved=300 * 1024**2, free=4 * GIB, used=12 * GIB - 300 * 1024**2
        ),
        "util": SimpleNamespace(gpu=91, memory=40),
        "encoder": [7, 167000],
        "decoder": [0, 167000],
        "temperature": 61,
        "power": 182_500,  # mW
        "power_limit": 320_000,
        "clocks": {0: 2520, 1: 2520, 2: 10501},
        "compute": [proc(100, 8 * GIB)],
        "graphics": [],
        "putil": [],
        # MIG and health (tests/test_nvml_mig.py, test_nvml_health.py): by default a GPU
        # without MIG, field values, clock event reasons or a fan; XID events register
        "mig_mode": err(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "mig": [],  # MIG devices by index: a dict each (see `mig_device`), None for a gap
        "fields": {},  # field id -> value (or an NVML error code as `err(...)`)
        "field_time_us": 1_796_000_000_000_000,
        "clock_reasons": err(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "throttle_reasons": err(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "fan": err(pynvml.NVML_ERROR_NOT_SUPPORTED),
        "events": None,
    }
    d.update(over)
    return d


def mig_device(gi: int, ci: int, total: int, used: int, compute: Any = ()) -> dict[str, Any]:
    """One MIG device of a mocked GPU: its ids, memory slice and process list."""
    return {
        "gi": gi,
        "ci": ci,
        "uuid": f"MIG-mock-{gi}-{ci}",
        "memory": SimpleNamespace(total=total, used=used, free=total - used),
        "compute": list(compute) if not isinstance(compute, Exception) else compute,
        "putil": err(pynvml.NVML_ERROR_NOT_SUPPORTED),
    }


class MigHandle(tuple):
    """A mocked MIG device handle: (parent index, MIG index)."""


class MockedNvml:
    """The subset of pynvml that nvml.py calls, answering from per-device dicts."""

    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU
    NVML_CLOCK_GRAPHICS = pynvml.NVML_CLOCK_GRAPHICS
    NVML_CLOCK_SM = pynvml.NVML_CLOCK_SM
    NVML_CLOCK_MEM = pynvml.NVML_CLOCK_MEM
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVMLError = pynvml.NVMLError  # pynvml's class: built from a field value's return code

    def __init__(self, devices: list[dict[str, Any]], init_error: Exception | None = None):
        self.devices = devices
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []
        self.pending_events: list[Any] = []  # what nvmlEventSetWait hands out, in order
        self.wait_timeouts: list[int] = []
        self.event_set_error: Exception | None = None
        self.freed: list[Any] = []
        self.field_requests: list[list[Any]] = []

    @staticmethod
    def _answer(value: Any) -> Any:
        if isinstance(value, Exception):
            raise value
        return value

    def _dev(self, h: Any, key: str) -> Any:
        self.calls.append(key)
        if isinstance(h, MigHandle):
            return self._answer(self.devices[h[0]]["mig"][h[1]][key])
        return self._answer(self.devices[h][key])

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.14"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if "handle" in self.devices[i]:
            self._answer(self.devices[i]["handle"])
        return i

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=self._dev(h, "bus"))

    def nvmlDeviceGetName(self, h: int) -> Any:
        return self._dev(h, "name")

    def nvmlDeviceGetUUID(self, h: int) -> Any:
        return self._dev(h, "uuid")

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:
        if version is not None and "memory_v2" in self.devices[h]:
            return self._dev(h, "memory_v2")
        return self._dev(h, "memory")

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return self._dev(h, "util")

    def nvmlDeviceGetEncoderUtilization(self, h: int) -> Any:
        return self._dev(h, "encoder")

    def nvmlDeviceGetDecoderUtilization(self, h: int) -> Any:
        return self._dev(h, "decoder")

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> Any:
        return self._dev(h, "temperature")

    def nvmlDeviceGetPowerUsage(self, h: int) -> Any:
        return self._dev(h, "power")

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> Any:
        return self._dev(h, "power_limit")

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> Any:
        return self._answer(self._dev(h, "clocks")[kind])

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> Any:
        return self._dev(h, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> Any:
        return self._dev(h, "graphics")

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> Any:
        return self._dev(h, "putil")

    # -- MIG

    def nvmlDeviceGetMigMode(self, h: int) -> Any:
        return self._dev(h, "mig_mode")

    def nvmlDeviceGetMaxMigDeviceCount(self, h: int) -> int:
        self.calls.append("mig_max")
        return len(self.devices[h]["mig"])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: int, i: int) -> MigHandle:
        self.calls.append("mig_handle")
        if self.devices[h]["mig"][i] is None:
            raise err(pynvml.NVML_ERROR_NOT_FOUND)
        return MigHandle((h, i))

    def nvmlDeviceGetGpuInstanceId(self, mh: MigHandle) -> int:
        return self._dev(mh, "gi")

    def nvmlDeviceGetComputeInstanceId(self, mh: MigHandle) -> int:
        return self._dev(mh, "ci")

    # -- health

    def nvmlEventSetCreate(self) -> Any:
        if self.event_set_error is not None:
            raise self.event_set_error
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, es: Any) -> None:
        assert types == pynvml.nvmlEventTypeXidCriticalError and es == "event-set"
        self._dev(h, "events")

    def nvmlEventSetWait(self, es: Any, timeout_ms: int) -> Any:
        self.wait_timeouts.append(timeout_ms)
        if not self.pending_events:
            raise err(pynvml.NVML_ERROR_TIMEOUT)
        return self._answer(self.pending_events.pop(0))

    def nvmlEventSetFree(self, es: Any) -> None:
        self.freed.append(es)

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[Any]) -> Any:
        """Answers as pynvml does: an array of the real c_nvmlFieldValue_t, each with its
        own return code and a value in the union member its valueType names."""
        got = self._dev(h, "fields")
        self.field_requests.append(list(ids))
        values = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for fv, want in zip(values, ids, strict=True):
            fid, scope = want if isinstance(want, tuple) else (want, 0)
            fv.fieldId, fv.scopeId = fid, scope
            fv.timestamp = self.devices[h]["field_time_us"]
            v = got.get(fid, err(pynvml.NVML_ERROR_NOT_SUPPORTED))
            if isinstance(v, pynvml.NVMLError):
                fv.nvmlReturn = v.value
            else:
                fv.nvmlReturn = pynvml.NVML_SUCCESS
                fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
                fv.value.ullVal = v
        return values

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> Any:
        return self._dev(h, "clock_reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> Any:
        return self._dev(h, "throttle_reasons")

    def nvmlDeviceGetFanSpeed(self, h: int) -> Any:
        return self._dev(h, "fan")


def sample(lib: MockedNvml):
    return NvmlBackend(lib).sample()


def test_nvml_mocked_healthy_device_metrics_are_measured_and_scaled():
    s = sample(MockedNvml([device(BUS_A)]))
    assert s.backend_problem is None and s.problems == ()
    (a,) = s.adapters
    assert a.pci_bus_id == BUS_A.lower() and a.name == "NVIDIA Mock GPU" and a.index == 0
    m = s.metrics[a.pci_bus_id]
    assert m.memory_total_bytes.value == 16 * GIB
    assert m.memory_reserved_bytes.value == 300 * 1024**2
    assert m.power_w.value == 182.5 and m.power_limit_w.value == 320.0
    assert m.clock_memory_mhz.value == 10501 and m.encoder_percent.value == 7
    for name in type(m).__slots__:
        r = getattr(m, name)
        assert r.kind is Kind.MEASURED and r.source.startswith("nvml:"), name
    assert s.driver_version == "550.54.14"


def test_nvml_mocked_init_is_lazy_and_once():
    lib = MockedNvml([device(BUS_A)])
    backend = NvmlBackend(lib)
    assert lib.init_calls == 0  # constructing does not touch NVML
    backend.sample()
    backend.sample()
    assert lib.init_calls == 1
    backend.close()
    assert lib.shutdown_calls == 1


def test_nvml_mocked_hidden_memory_is_na_with_reason_never_zero():
    dev = device(
        BUS_A,
        compute=[proc(100, None), proc(101, NOT_AVAILABLE_ULL), proc(102, 0), proc(103, 2 * GIB)],
    )
    s = sample(MockedNvml([dev]))
    by_pid = {p.pid: p for p in s.processes}
    for pid in (100, 101):
        r = by_pid[pid].dedicated
        assert r.value is None and r.reason is Reason.HIDDEN and r.kind is Kind.MEASURED
    assert by_pid[102].dedicated.value == 0 and by_pid[102].dedicated.reason is None
    c = Collector(source=NvmlBackend(MockedNvml([dev])), scanner=NullScanner())
    snap = c.sample()
    assert snap.attributed == 2 * GIB  # the measured zero and 2 GiB; hidden adds nothing
    assert snap.attributed_complete is False
    doc = report.to_json_dict(snap, None)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert report.null_rule_violations(doc) == []
    hidden = next(p for p in doc["processes"] if p["pid"] == 100)
    assert hidden["vram_bytes"]["value"] is None
    assert hidden["vram_bytes"]["reason"] == "hidden by driver"


def test_nvml_mocked_failed_process_list_is_a_failure_not_an_empty_list():
    dev = device(
        BUS_A, compute=err(pynvml.NVML_ERROR_NO_PERMISSION), graphics=[proc(200, 64 * 1024**2)]
    )
    s = sample(MockedNvml([dev]))
    (p,) = s.problems
    assert (p.where, p.reason, p.adapter) == ("processes.compute", Reason.DENIED, BUS_A.lower())
    assert [x.pid for x in s.processes] == [200]  # the graphics list still answered
    snap = Collector(source=NvmlBackend(MockedNvml([dev])), scanner=NullScanner()).sample()
    assert snap.attributed_complete is False
    doc = report.to_json_dict(snap, None)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    status = doc["adapters"][0]["process_list"]
    assert status["graphics"] == "ok" and status["compute"]["reason"] == "denied"


def test_nvml_mocked_not_supported_fields_are_missing_independently():
    dev = device(
        BUS_A,
        encoder=err(pynvml.NVML_ERROR_NOT_SUPPORTED),
        power=err(pynvml.NVML_ERROR_NOT_SUPPORTED),
        temperature=NOT_AVAILABLE_UINT,
        putil=err(pynvml.NVML_ERROR_NOT_SUPPORTED),
    )
    s = sample(MockedNvml([dev]))
    m = s.metrics[BUS_A.lower()]
    assert m.encoder_percent.value is None and m.encoder_percent.reason is Reason.NOT_SUPPORTED
    assert m.encoder_percent.detail == "Not Supported"
    assert m.power_w.reason is Reason.NOT_SUPPORTED
    assert m.temperature_c.value is None and m.temperature_c.reason is Reason.UNAVAILABLE
    assert m.decoder_percent.value == 0  # measured zero next to unsupported neighbours
    (p,) = s.processes
    # engines unsupported, memory still measured: the two are independent
    assert p.dedicated.value == 8 * GIB
    assert p.engines["gpu_percent"].reason is Reason.NOT_SUPPORTED


def test_nvml_mocked_memory_v2_unsupported_falls_back_to_v1():
    dev = device(
        BUS_A,
        memory_v2=err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND),
        memory=SimpleNamespace(total=8 * GIB, free=GIB, used=7 * GIB),
    )
    m = sample(MockedNvml([dev])).metrics[BUS_A.lower()]
    assert m.memory_total_bytes.value == 8 * GIB and m.memory_used_bytes.value == 7 * GIB
    assert m.memory_reserved_bytes.value is None
    assert m.memory_reserved_bytes.reason is Reason.NOT_SUPPORTED


def test_nvml_mocked_per_process_engine_samples():
    sample_row = SimpleNamespace(
        pid=100, smUtil=55, memUtil=20, encUtil=0, decUtil=3, timeStamp=1_000_000
    )
    dev = device(BUS_A, compute=[proc(100, GIB), proc(101, GIB)], putil=[sample_row])
    s = sample(MockedNvml([dev]))
    by_pid = {p.pid: p for p in s.processes}
    assert by_pid[100].engines["gpu_percent"].value == 55
    assert by_pid[100].engines["encoder_percent"].value == 0
    assert by_pid[101].engines["gpu_percent"].value is None
    assert by_pid[101].engines["gpu_percent"].reason is Reason.UNAVAILABLE
    none_yet = device(BUS_A, putil=err(pynvml.NVML_ERROR_NOT_FOUND))
    (p,) = sample(MockedNvml([none_yet])).processes
    assert p.engines["gpu_percent"].reason is Reason.UNAVAILABLE


def test_nvml_mocked_process_in_both_lists_is_one_row_not_double_counted():
    dev = device(BUS_A, compute=[proc(300, 3 * GIB)], graphics=[proc(300, 3 * GIB)])
    s = sample(MockedNvml([dev]))
    (p,) = s.processes
    assert p.contexts == ("compute", "graphics") and p.dedicated.value == 3 * GIB


def test_nvml_mocked_pairs_by_pci_bus_id_when_enumeration_order_changes():
    a = device(BUS_A, name="Same Name", compute=[proc(1, GIB)])
    b = device(BUS_B, name="Same Name", compute=[proc(2, 2 * GIB)])
    lib = MockedNvml([a, b])
    backend = NvmlBackend(lib)
    first = backend.sample()
    lib.devices = [b, a]  # same GPUs, enumerated the other way round
    second = backend.sample()
    for s in (first, second):
        on_b = [p.pid for p in s.processes if p.adapter == BUS_B.lower()]
        assert on_b == [2]
        assert s.problems == ()
    assert {x.pci_bus_id: x.index for x in second.adapters} == {BUS_B.lower(): 0, BUS_A.lower(): 1}


def test_nvml_mocked_gpu_disappearing_between_samples_is_shown_as_lost():
    a, b = device(BUS_A), device(BUS_B, compute=[proc(9, GIB)])
    lib = MockedNvml([a, b])
    backend = NvmlBackend(lib)
    assert len(backend.sample().adapters) == 2
    lib.devices = [a]  # BUS_B fell off the bus
    s = backend.sample()
    assert [x.pci_bus_id for x in s.adapters] == [BUS_A.lower(), BUS_B.lower()]
    lost = s.metrics[BUS_B.lower()]
    assert lost.memory_used_bytes.value is None and lost.memory_used_bytes.reason is Reason.GPU_LOST
    assert not [p for p in s.processes if p.adapter == BUS_B.lower()]
    wheres = {(p.where, p.adapter) for p in s.problems if p.reason is Reason.GPU_LOST}
    assert ("processes.compute", BUS_B.lower()) in wheres and ("adapter", BUS_B.lower()) in wheres
    # the healthy GPU is unaffected
    assert s.metrics[BUS_A.lower()].memory_used_bytes.kind is Kind.MEASURED
    assert s.metrics[BUS_A.lower()].memory_used_bytes.value is not None


def test_nvml_mocked_gpu_lost_mid_sample_stops_calling_that_gpu():
    dev = device(BUS_A, util=err(pynvml.NVML_ERROR_GPU_IS_LOST))
    lib = MockedNvml([dev, device(BUS_B)])
    s = sample(lib)
    m = s.metrics[BUS_A.lower()]
    assert all(getattr(m, f).reason is Reason.GPU_LOST for f in type(m).__slots__)
    assert {p.where for p in s.problems if p.adapter == BUS_A.lower()} == {
        "processes.compute",
        "processes.graphics",
    }
    assert s.metrics[BUS_B.lower()].util_gpu_percent.value == 91
    calls_on_a = lib.calls[: lib.calls.index("util") + 1]
    assert "compute" not in calls_on_a  # nothing more was asked of the lost GPU


def test_nvml_mocked_handle_failure_skips_one_gpu_with_a_reason():
    bad = device(BUS_A, handle=err(pynvml.NVML_ERROR_NO_PERMISSION))
    s = sample(MockedNvml([bad, device(BUS_B)]))
    assert [a.pci_bus_id for a in s.adapters] == [BUS_B.lower()]
    assert any(p.where == "device.0" and p.reason is Reason.DENIED for p in s.problems)


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, Reason.NO_LIBRARY),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, Reason.NO_DRIVER),
        (pynvml.NVML_ERROR_NO_PERMISSION, Reason.DENIED),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, Reason.QUERY_FAILED),
    ],
)
def test_nvml_mocked_init_failure_degrades_with_reason_and_is_not_retried(code, reason):
    lib = MockedNvml([device(BUS_A)], init_error=err(code))
    backend = NvmlBackend(lib)
    s = backend.sample()
    assert s.adapters == () and s.backend_problem is not None
    assert s.backend_problem.reason is reason and s.backend_problem.detail
    backend.sample()
    assert lib.init_calls == 1
    snap = Collector(
        source=NvmlBackend(MockedNvml([], init_error=err(code))), scanner=NullScanner()
    ).sample()
    doc = report.to_json_dict(snap, None)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert doc["available"] is False and doc["unavailable"]["reason"] == str(reason)
    assert report.null_rule_violations(doc) == []


def test_nvml_mocked_zero_gpus_is_an_answer_not_a_failure():
    snap = Collector(source=NvmlBackend(MockedNvml([])), scanner=NullScanner()).sample()
    assert snap.available and snap.adapters == ()
    assert "NVML answered but lists no GPU" in snap.notes


def test_error_map_uses_the_binding_classes():
    assert reason_for(err(pynvml.NVML_ERROR_GPU_IS_LOST)) is Reason.GPU_LOST
    assert reason_for(err(pynvml.NVML_ERROR_NOT_SUPPORTED)) is Reason.NOT_SUPPORTED
    assert reason_for(RuntimeError("binding bug")) is Reason.QUERY_FAILED


def test_nvml_real_binding_without_library_reports_library_not_found():
    """Not mocked: the installed pynvml on a machine without libnvidia-ml.so.1."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("libnvidia-ml is installed here; this checks the no-driver path")
    s = NvmlBackend().sample()
    assert s.backend_problem is not None
    assert s.backend_problem.reason is Reason.NO_LIBRARY
    assert "Not Found" in (s.backend_problem.detail or "")


def test_nvml_real_binding_init_raises_library_not_found_and_maps_to_it():
    """Not mocked: the real pynvml module passed in, so its own nvmlInit() runs (FACTS.md:
    without a driver it raises NVMLError_LibraryNotFound)."""
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("libnvidia-ml is installed here; this checks the no-driver path")
    s = NvmlBackend(pynvml).sample()
    assert s.backend_problem is not None
    assert s.backend_problem.reason is Reason.NO_LIBRARY
    assert s.backend_problem.detail == "NVML Shared Library Not Found"


def test_nvml_mocked_collector_joins_real_process_identity_and_scan():
    """NVML mocked; /proc, the host sampler and procinfo are real. NVML lists this test
    process and a PID that has no /proc entry here (as from another PID namespace)."""
    import os

    import psutil

    ghost = 2**22 + 12345  # above the kernel's pid_max limit, so never a real process
    dev = device(BUS_A, compute=[proc(os.getpid(), GIB), proc(ghost, 2 * GIB)])
    c = Collector(source=NvmlBackend(MockedNvml([dev])), scan_budget=None)
    snap, system = c.sample_with_system()
    rows = {p.pid: p for p in snap.processes if p.adapter == BUS_A.lower()}
    me = rows[os.getpid()]
    assert me.create_time == pytest.approx(psutil.Process().create_time(), abs=0.01)
    assert me.name and me.detail.scanned and me.detail.cmdline
    g = rows[ghost]
    assert g.name is None and g.create_time is None and not g.detail.scanned
    assert g.detail.reason is Reason.UNAVAILABLE and "PID namespace" in g.detail.reason_detail
    assert g.dedicated.value == 2 * GIB  # the driver's number stands even without /proc
    doc = report.to_json_dict(snap, system)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert report.null_rule_violations(doc) == []
    row = next(p for p in doc["processes"] if p["pid"] == os.getpid())
    assert row["ram_bytes"]["value"] > 0
    assert doc["attributed_bytes"] == 3 * GIB
