"""NVML health readings (XID events, ECC, retired pages, remapped rows, clock event reasons,
fan, PCIe and NVLink rates) and the health verdict, through the mocked NVML of
test_nvml_mocked (this machine has no NVIDIA GPU): not validated on hardware."""

from __future__ import annotations

from types import SimpleNamespace

import pynvml
import pytest
from gputaskman.backends.nvml import NvmlBackend
from gputaskman.base import schema
from gputaskman.base.gpuhealth import HEALTH_FIELDS, OK, UNHEALTHY, UNKNOWN, verdict
from gputaskman.base.readings import Kind, Reading, Reason
from gputaskman.document.reader import read_document
from gputaskman.render import report, report_health
from gputaskman.sampling.collector import Collector, NullScanner
from test_nvml_mocked import BUS_A, BUS_B, MockedNvml, device, err

BUS_C = "00000000:81:00.0"
A, B, C = BUS_A.lower(), BUS_B.lower(), BUS_C
SECOND = 1_000_000  # µs

# ECC (SBE/DBE volatile, aggregate), remapped rows, PCIe and NVLink counters; no retired pages
FIELDS = {
    3: 2,
    4: 0,
    5: 10,
    6: 1,
    29: err(pynvml.NVML_ERROR_NOT_SUPPORTED),
    30: err(pynvml.NVML_ERROR_NOT_SUPPORTED),
    31: err(pynvml.NVML_ERROR_NOT_SUPPORTED),
    142: 3,
    143: 0,
    144: 0,
    145: 0,
    197: 1_000_000,
    198: 5_000_000,
    138: 100,
    139: 200,
}


def healthy(bus: str = BUS_A, **over):
    """A GPU with every health counter but retired pages (it remaps rows), idle clocks."""
    return device(bus, **{"fields": dict(FIELDS), "clock_reasons": 0x1, "fan": 45, **over})


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def xid_event(dev: int, code: int) -> SimpleNamespace:
    return SimpleNamespace(
        device=dev,
        eventType=pynvml.nvmlEventTypeXidCriticalError,
        eventData=code,
        gpuInstanceId=0xFFFFFFFF,
        computeInstanceId=0xFFFFFFFF,
    )


def test_nvml_mocked_health_counters_come_from_one_field_values_call_each_with_its_reason():
    lib = MockedNvml([healthy()])
    h = NvmlBackend(lib).sample().health[A]
    assert list(h) == list(HEALTH_FIELDS)  # every reading, in the declared order
    assert h["ecc_volatile_corrected_errors"].value == 2
    assert h["ecc_volatile_uncorrected_errors"].value == 0  # a measured zero stays 0
    assert h["ecc_aggregate_corrected_errors"].value == 10
    assert h["ecc_aggregate_uncorrected_errors"].value == 1
    assert h["remapped_rows_correctable"].value == 3 and h["remapped_rows_failure"].value == 0
    assert h["ecc_volatile_corrected_errors"].kind is Kind.MEASURED
    assert "NVML_FI_DEV_ECC_SBE_VOL_TOTAL" in h["ecc_volatile_corrected_errors"].source
    # a GPU that remaps rows has no retired-page counters: n/a with NVML's reason, never 0
    for key in ("retired_pages_single_bit", "retired_pages_double_bit", "retired_pages_pending"):
        assert h[key].value is None and h[key].reason is Reason.NOT_SUPPORTED, key
        assert h[key].detail == "Not Supported"
    assert h["clocks_event_reasons"].value == 0x1
    assert h["clocks_event_reasons"].source == "nvml:nvmlDeviceGetCurrentClocksEventReasons"
    assert h["fan_speed_percent"].value == 45
    assert lib.calls.count("fields") == 1


def test_nvml_mocked_fields_a_gpu_lacks_are_not_asked_again():
    lib = MockedNvml([healthy()])
    backend = NvmlBackend(lib)
    backend.sample()
    h = backend.sample().health[A]
    first, second = lib.field_requests
    assert len(first) == 15 and {29, 30, 31} & set(first) == {29, 30, 31}
    assert len(second) == 12 and not {29, 30, 31} & set(second)  # retired pages: dropped
    assert h["retired_pages_pending"].reason is Reason.NOT_SUPPORTED  # still said why
    assert h["ecc_volatile_corrected_errors"].value == 2


def test_nvml_mocked_pcie_and_nvlink_rates_from_counter_deltas_over_nvml_timestamps():
    dev = healthy()
    lib = MockedNvml([dev])
    backend = NvmlBackend(lib)
    first = backend.sample().health[A]
    for key in ("pcie_tx_bytes_per_second", "nvlink_rx_bytes_per_second"):
        assert first[key].value is None and first[key].reason is Reason.UNAVAILABLE
        assert first[key].detail == "a rate needs two samples"
    dev["field_time_us"] += 2 * SECOND
    dev["fields"].update({197: 1_000_000 + 4_000_000, 198: 5_000_000, 138: 100 + 2048})
    second = backend.sample().health[A]
    assert second["pcie_tx_bytes_per_second"].value == 2_000_000
    assert second["pcie_rx_bytes_per_second"].value == 0  # no traffic is a measured zero
    assert second["nvlink_tx_bytes_per_second"].value == 2048 * 1024 // 2  # KiB counters
    assert second["nvlink_tx_bytes_per_second"].kind is Kind.MEASURED
    dev["field_time_us"] += SECOND
    dev["fields"][197] = 10  # wrapped or reset: no rate this time, never a negative one
    third = backend.sample().health[A]
    assert third["pcie_tx_bytes_per_second"].value is None
    assert "backwards" in (third["pcie_tx_bytes_per_second"].detail or "")


def test_nvml_mocked_xid_events_are_counted_per_gpu_without_waiting():
    clock = Clock()
    lib = MockedNvml([healthy(), healthy(BUS_B), healthy(BUS_C)])
    backend = NvmlBackend(lib, clock=clock)
    first = backend.sample()
    for key in ("xid_critical_errors", "xid_last", "xid_watched_seconds"):
        r = first.health[A][key]
        assert r.value is None and r.reason is Reason.UNAVAILABLE  # a count needs time
        assert "watching began with this sample" in (r.detail or "")
    lib.pending_events = [xid_event(0, 79), xid_event(2, 31), xid_event(0, 48)]
    clock.t += 30
    second = backend.sample()
    a, b = second.health[A], second.health[B]
    assert a["xid_critical_errors"].value == 2 and a["xid_last"].value == 48
    c = second.health[C]  # each event on the GPU it names, by PCI bus id
    assert c["xid_critical_errors"].value == 1 and c["xid_last"].value == 31
    assert a["xid_watched_seconds"].value == 30.0
    assert b["xid_critical_errors"].value == 0  # GPU B had none: a measured zero
    assert b["xid_last"].value is None and b["xid_last"].reason is Reason.UNAVAILABLE
    assert set(lib.wait_timeouts) == {0}  # never blocks a refresh
    assert verdict(a).state == UNHEALTHY and "latest XID 48" in verdict(a).reasons[0]
    assert verdict(b).state == OK
    backend.close()
    assert lib.freed == ["event-set"]


def test_nvml_mocked_xid_events_drained_at_most_max_per_refresh():
    from gputaskman.backends.nvml_health import MAX_EVENTS

    lib = MockedNvml([healthy()])
    backend = NvmlBackend(lib)
    backend.sample()
    lib.pending_events = [xid_event(0, 13)] * (MAX_EVENTS + 5)
    assert backend.sample().health[A]["xid_critical_errors"].value == MAX_EVENTS
    assert backend.sample().health[A]["xid_critical_errors"].value == MAX_EVENTS + 5


def test_nvml_mocked_xid_unsupported_or_no_event_set_is_na_with_the_reason():
    lib = MockedNvml([healthy(events=err(pynvml.NVML_ERROR_NOT_SUPPORTED))])
    backend = NvmlBackend(lib)
    backend.sample()
    h = backend.sample().health[A]
    assert h["xid_critical_errors"].value is None
    assert h["xid_critical_errors"].reason is Reason.NOT_SUPPORTED
    assert lib.calls.count("events") == 1  # registration is not retried every refresh
    assert verdict(h).state == OK  # the other checks ran; XID is listed as not checked
    assert any(u.startswith("xid_critical_errors") for u in verdict(h).unchecked)
    lib2 = MockedNvml([healthy()])
    lib2.event_set_error = err(pynvml.NVML_ERROR_NO_PERMISSION)
    backend2 = NvmlBackend(lib2)
    backend2.sample()
    assert backend2.sample().health[A]["xid_critical_errors"].reason is Reason.DENIED


def test_nvml_mocked_unsupported_health_calls_are_asked_once():
    # no field values, clock reasons, fan or XID events
    lib = MockedNvml([device(BUS_A, events=err(pynvml.NVML_ERROR_NOT_SUPPORTED))])
    backend = NvmlBackend(lib)
    for _ in range(3):
        h = backend.sample().health[A]
    assert h["fan_speed_percent"].reason is Reason.NOT_SUPPORTED
    assert lib.calls.count("fan") == 1 and lib.calls.count("clock_reasons") == 1
    assert lib.calls.count("fields") == 1  # every field unsupported: no call after the first
    assert h["ecc_volatile_uncorrected_errors"].reason is Reason.NOT_SUPPORTED
    assert verdict(h).state == UNKNOWN  # nothing could be checked: never "ok"


def test_nvml_mocked_clock_reasons_fall_back_to_the_throttle_call_on_older_drivers():
    dev = healthy(
        clock_reasons=err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND), throttle_reasons=0x40 | 0x4
    )
    h = NvmlBackend(MockedNvml([dev])).sample().health[A]
    r = h["clocks_event_reasons"]
    assert r.value == 0x44 and r.source == "nvml:nvmlDeviceGetCurrentClocksThrottleReasons"
    v = verdict(h)
    assert v.state == UNHEALTHY
    assert v.reasons == ("clocks slowed: hardware thermal slowdown",)  # not the power cap


def test_nvml_mocked_gpu_lost_in_the_health_call_loses_the_rest():
    dev = healthy(fan=err(pynvml.NVML_ERROR_GPU_IS_LOST))
    s = NvmlBackend(MockedNvml([dev, healthy(BUS_B)])).sample()
    assert all(r.reason is Reason.GPU_LOST for r in s.health[A].values())
    assert s.health[B]["fan_speed_percent"].value == 45


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("xid_critical_errors", 1, "critical XID"),
        ("ecc_volatile_uncorrected_errors", 3, "3 uncorrected ECC errors"),
        ("retired_pages_pending", 1, "page retirement waits"),
        ("remapped_rows_pending", 1, "row remap waits"),
        ("remapped_rows_failure", 1, "row remap failed"),
        ("clocks_event_reasons", 0x8, "hardware slowdown"),
        ("clocks_event_reasons", 0x20, "software thermal slowdown"),
        ("clocks_event_reasons", 0x80, "hardware power brake"),
    ],
)
def test_health_verdict_flags_each_unhealthy_reading(key: str, value: int, says: str):
    fine = {k: Reading.measured(0, "test") for k in HEALTH_FIELDS}
    assert verdict(fine).state == OK and verdict(fine).unchecked == ()
    bad = {**fine, key: Reading.measured(value, "test")}
    v = verdict(bad)
    assert v.state == UNHEALTHY and any(says in r for r in v.reasons), v.reasons


def test_health_verdict_power_cap_idle_and_corrected_errors_are_not_unhealthy():
    h = {k: Reading.measured(0, "test") for k in HEALTH_FIELDS}
    h["clocks_event_reasons"] = Reading.measured(0x1 | 0x2 | 0x4 | 0x10, "test")
    h["ecc_volatile_corrected_errors"] = Reading.measured(500, "test")
    h["ecc_aggregate_uncorrected_errors"] = Reading.measured(2, "test")  # a past life
    assert verdict(h).state == OK


def test_nvml_mocked_health_in_the_json_document_and_read_back():
    lib = MockedNvml([healthy(clock_reasons=0x40)])
    c = Collector(source=NvmlBackend(lib), scanner=NullScanner())
    c.sample()
    snap = c.sample()
    doc = report.to_json_dict(snap, None)
    assert schema.errors(doc) == [] and report.null_rule_violations(doc) == []
    a = doc["adapters"][0]
    assert a["health"]["fan_speed_percent"]["value"] == 45
    assert a["health"]["retired_pages_pending"]["reason"] == "not supported"
    assert a["health_state"]["state"] == "unhealthy"
    assert a["health_state"]["reasons"] == ["clocks slowed: hardware thermal slowdown"]
    back = read_document(doc)
    assert dict(back.adapters[0].health) == dict(snap.health[A])
    again = report.to_json_dict(back.snapshot(), None)
    assert again["adapters"][0]["health"] == a["health"]
    lines = report_health.health_lines(snap, A)
    assert lines[0].startswith("health  UNHEALTHY: clocks slowed: hardware thermal slowdown")
    assert "retired n/a (not supported)" in lines[2]
    assert "fan 45%" in lines[3] and "hardware thermal slowdown" in lines[3]


def test_health_of_a_backend_without_health_is_absent_not_ok():
    from gputaskman.fixtures.demo import demo_snapshot

    doc = report.to_json_dict(demo_snapshot(), None)
    assert all(a["health"] == {} and a["health_state"] is None for a in doc["adapters"])
    assert all(a["mig"] is None for a in doc["adapters"])
    assert report_health.health_lines(demo_snapshot(), doc["adapters"][0]["pci_bus_id"]) == []


def test_the_tui_header_shows_the_health_and_mig_of_the_focused_gpu():
    """The GPU's line says UNHEALTHY; its details give why, every reading and the MIG
    instances (compact: the verdict only)."""
    from gputaskman.tui.widgets.gpu_header import gpu_text
    from test_schema import _mig_and_health_doc

    snap = read_document(_mig_and_health_doc()).snapshot()
    (a,) = snap.adapters
    text = gpu_text(snap, a, width=200).plain
    first = text.splitlines()[0]
    assert "UNHEALTHY" in first
    assert "health  UNHEALTHY: 1 critical XID event since watching began (latest XID 79)" in text
    assert "hardware thermal slowdown" in text and "fan 50%" in text
    assert "MIG     enabled, 1 instance(s)" in text and "1/0  memory 1.0 GiB / 40.0 GiB" in text
    compact = gpu_text(snap, a, width=200, compact=True).plain
    assert "health  UNHEALTHY" in compact and "MIG" not in compact
