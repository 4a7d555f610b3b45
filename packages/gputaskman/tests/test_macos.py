"""macOS (Apple Silicon) backend over mocked IOKit and footprint answers (no Mac here).

The IOKit property names (``PerformanceStatistics`` with ``In use system memory`` and
``Device Utilization %``; user clients as children of the accelerator, each with
``IOUserClientCreator`` = ``"pid 533, WindowServer"`` and ``AppUsage[].accumulatedGPUTime``
in ns) are the ones public macOS monitors read; the values are made up. Nothing here
validates Apple hardware.
"""

from __future__ import annotations

import ctypes

import pytest
from gputaskman.backends.macos import (
    Accelerator,
    CtypesFootprint,
    CtypesIOKit,
    MacCounters,
    gpu_time_ns,
    parse_creator,
    rusage_info_v0,
    task_vm_info,
)
from gputaskman.base import schema
from gputaskman.base.readings import Kind, Reason
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner
from hypothesis import given
from hypothesis import strategies as st

GIB = 1024**3
MIB = 1024**2
OWN, OTHER = 4242, 533


def client(pid: int, name: str, gpu_ns: int | None, api: str = "Metal") -> dict:
    props: dict = {"IOUserClientCreator": f"pid {pid}, {name}"}
    if gpu_ns is not None:
        props["AppUsage"] = [{"API": api, "accumulatedGPUTime": gpu_ns}]
    return props


def agx(clients, perf: dict | None = None, rid: int = 0x100000ABC) -> Accelerator:
    props: dict = {"model": "Apple M4", "gpu-core-count": 10}
    if perf is not False:
        props["PerformanceStatistics"] = perf or {
            "In use system memory": 6 * GIB,
            "Alloc system memory": 9 * GIB,
            "Device Utilization %": 37,
            "Renderer Utilization %": 30,
            "Tiler Utilization %": 12,
        }
    return Accelerator(rid, "AGXAcceleratorG16X", props, clients)


class FakeIOKit:
    def __init__(self, *steps):
        self.steps = list(steps)

    def accelerators(self):
        step = self.steps.pop(0) if len(self.steps) > 1 else self.steps[0]
        if isinstance(step, Exception):
            raise step
        return step


class FakeFootprint:
    """Mocked system accounting: own-user processes readable, others EPERM; graphics
    ledgers only with `root`."""

    def __init__(self, root: bool = False) -> None:
        self.root = root

    def phys_footprint(self, pid: int) -> int:
        if pid == OTHER and not self.root:
            raise PermissionError(1, "proc_pid_rusage: Operation not permitted")
        if pid == 999:
            raise ProcessLookupError(3, "gone")
        return 5 * GIB if pid == OWN else 300 * MIB

    def graphics(self, pid: int) -> tuple[int, int]:
        if not self.root:
            raise PermissionError("task_for_pid refused")
        return (4 * GIB, 512 * MIB) if pid == OWN else (200 * MIB, 0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("pid 533, WindowServer", (533, "WindowServer")),
        ("pid 12", (12, None)),
        ("  pid 7 ,  Google Chrome Helper (GPU) ", (7, "Google Chrome Helper (GPU)")),
        ("WindowServer", None),
        ("pid x, a", None),
        (533, None),
        (None, None),
    ],
)
def test_parse_creator(text, want):
    assert parse_creator(text) == want


@given(st.one_of(st.text(max_size=80), st.integers(), st.none()))
def test_parse_creator_fuzz_never_raises(text):
    r = parse_creator(text)
    assert r is None or r[0] >= 0


def test_gpu_time_from_app_usage_or_direct():
    assert gpu_time_ns({"AppUsage": [{"accumulatedGPUTime": 5}, {"accumulatedGPUTime": 7}]}) == 12
    assert gpu_time_ns({"accumulatedGPUTime": 9}) == 9  # Intel Macs put it on the client
    assert gpu_time_ns({"AppUsage": [{"API": "Metal"}]}) is None
    assert gpu_time_ns({"AppUsage": "nonsense"}) is None
    assert gpu_time_ns({"accumulatedGPUTime": True}) is None
    assert gpu_time_ns({"accumulatedGPUTime": -1}) is None
    assert gpu_time_ns({}) is None


def test_metal_mocked_device_readings_and_unified_total():
    s = MacCounters(FakeIOKit([agx([])]), FakeFootprint(), memsize=lambda: 32 * GIB).sample()
    (a,) = s.adapters
    assert a.vendor == "apple" and a.name == "Apple M4" and a.pci_bus_id == "iokit:0x100000abc"
    m = s.metrics[a.pci_bus_id]
    assert m.memory_used_bytes.value == 6 * GIB and m.memory_used_bytes.kind is Kind.MEASURED
    assert "In use system memory" in m.memory_used_bytes.source
    assert m.util_gpu_percent.value == 37
    assert m.memory_total_bytes.value == 32 * GIB
    assert "unified" in (m.memory_total_bytes.detail or "")
    assert m.temperature_c.reason is Reason.NOT_SUPPORTED
    assert s.probe.status == "ok" and s.probe.count == 1


def test_metal_mocked_own_user_processes_without_root():
    s = MacCounters(
        FakeIOKit([agx([client(OWN, "llama-server", 10), client(OTHER, "WindowServer", 10)])]),
        FakeFootprint(root=False),
        memsize=lambda: 32 * GIB,
    ).sample()
    by = {p.pid: p for p in s.processes}
    own, other = by[OWN], by[OTHER]
    assert own.name == "llama-server" and other.name == "WindowServer"
    # footprint: own process measured, another user's denied (never 0)
    assert own.footprint is not None and own.footprint.value == 5 * GIB
    assert other.footprint is not None and other.footprint.reason is Reason.DENIED
    # without a task port the GPU bytes and the compressed part are denied, with a reason
    assert own.dedicated.value is None and own.dedicated.reason is Reason.DENIED
    assert own.paged is not None and own.paged.reason is Reason.DENIED
    assert "root" in (own.dedicated.detail or "")


def test_metal_mocked_as_root_graphics_ledgers_are_measured_and_compressed_is_paged():
    backend = MacCounters(
        FakeIOKit([agx([client(OWN, "llama-server", 10), client(OTHER, "WindowServer", 10)])]),
        FakeFootprint(root=True),
        memsize=lambda: 32 * GIB,
    )
    snap = Collector(source=backend, scanner=NullScanner()).sample()
    key = "iokit:0x100000abc"
    # graphics footprints are summed; compressed (Paged) and phys footprints never are
    assert snap.attributed_on(key) == 4 * GIB + 200 * MIB
    s = backend.sample()
    own = next(p for p in s.processes if p.pid == OWN)
    assert (
        own.dedicated.value == 4 * GIB and "ledger_tag_graphics_footprint" in own.dedicated.source
    )
    assert own.paged is not None and own.paged.value == 512 * MIB
    other = next(p for p in s.processes if p.pid == OTHER)
    assert other.paged is not None and other.paged.value == 0  # a measured zero stays 0
    assert report.null_rule_violations(report.to_json_dict(snap, None)) == []
    assert schema.errors(report.to_json_dict(snap, None)) == []  # the packaged JSON Schema


def test_metal_mocked_gpu_percent_is_a_rate_of_accumulated_time():
    clock = Clock()
    iokit = FakeIOKit(
        [agx([client(OWN, "llama-server", 1_000_000_000)])],
        [agx([client(OWN, "llama-server", 1_250_000_000)])],
        [agx([client(OWN, "llama-server", 5)])],  # restarted client: time went backwards
    )
    b = MacCounters(iokit, FakeFootprint(), memsize=lambda: None, clock=clock)
    first = b.sample().processes[0].engines["gpu_percent"]
    assert first.value is None and "two samples" in (first.detail or "")
    clock.t += 1.0
    second = b.sample().processes[0].engines["gpu_percent"]
    assert second.value == 25.0 and second.kind is Kind.MEASURED
    clock.t += 1.0
    third = b.sample().processes[0].engines["gpu_percent"]
    assert third.value is None and "backwards" in (third.detail or "")


def test_metal_mocked_clients_of_one_process_add_their_gpu_time():
    clock = Clock()
    two = lambda a, b: [agx([client(OWN, "x", a, "Metal"), client(OWN, "x", b, "CoreML")])]  # noqa: E731
    b = MacCounters(
        FakeIOKit(two(100, 200), two(100 + 10**8, 200 + 10**8)),
        FakeFootprint(),
        memsize=lambda: None,
        clock=clock,
    )
    assert len(b.sample().processes) == 1
    clock.t += 1.0
    (p,) = b.sample().processes
    assert p.engines["gpu_percent"].value == 20.0


def test_metal_mocked_failed_queries_are_unavailable_with_reasons():
    bad = {"IOUserClientCreator": "garbage"}
    s = MacCounters(
        FakeIOKit([agx([bad, client(999, "gone", None)], perf=False)]),
        FakeFootprint(),
        memsize=lambda: None,
    ).sample()
    m = s.metrics["iokit:0x100000abc"]
    assert m.memory_used_bytes.reason is Reason.UNAVAILABLE
    assert "PerformanceStatistics" in (m.memory_used_bytes.detail or "")
    assert m.memory_total_bytes.reason is Reason.UNAVAILABLE
    assert any(
        p.where == "processes.iokit" and "1 GPU clients" in (p.detail or "") for p in s.problems
    )
    (gone,) = s.processes
    assert gone.footprint is not None and gone.footprint.reason is Reason.PROCESS_GONE
    assert gone.engines["gpu_percent"].reason is Reason.NOT_SUPPORTED


def test_metal_mocked_probe_tells_empty_from_failed():
    empty = MacCounters(FakeIOKit([]), FakeFootprint(), memsize=lambda: None).sample()
    assert empty.probe.status == "empty" and empty.backend_problem is None
    failed = MacCounters(
        FakeIOKit(OSError("IOServiceGetMatchingServices failed")),
        FakeFootprint(),
        memsize=lambda: None,
    ).sample()
    assert failed.probe.status == "failed" and "IOServiceGetMatchingServices" in failed.probe.line()


def test_metal_ctypes_structures_match_the_sdk_layout():
    assert rusage_info_v0.ri_phys_footprint.offset == 72
    assert ctypes.sizeof(rusage_info_v0) == 96
    assert task_vm_info.phys_footprint.offset == 144
    assert task_vm_info.ledger_tag_graphics_footprint.offset == 272
    assert task_vm_info.ledger_tag_graphics_footprint_compressed.offset == 280


def test_metal_ctypes_layers_refuse_off_macos():
    with pytest.raises(OSError, match="macOS only"):
        CtypesIOKit().accelerators()
    with pytest.raises(OSError, match="macOS only"):
        CtypesFootprint().phys_footprint(1)
