"""Host sampling on Windows and macOS (hostplat.py) over the platform modules' mocks.

There is no Windows or macOS here: PDH answers come from the WDDM tests' `FakePdh`, the
macOS total from a `memsize` callable as in the Metal tests. What is checked for real: that
no /proc path is ever opened or listed, that every unread field is unknown with a reason
(never 0), and that the report, the null rules and the exporter take the result unchanged.
"""

from __future__ import annotations

import builtins
import os
import sys
import time
from pathlib import Path

import pytest
from gputaskman.backends.win import pdh
from gputaskman.backends.win.pdh import CounterRead
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuSample, GpuSource
from gputaskman.base.readings import Reason
from gputaskman.render import report, text_report
from gputaskman.render.exporter_system import system_families
from gputaskman.render.report_models import system_json
from gputaskman.sampling import collector, host, hostplat

sys.path.insert(0, str(Path(__file__).parent))
from test_win_pdh import FakePdh  # the WDDM tests' mocked PDH

GIB = 1 << 30
FIRST = {
    pdh.MEMORY_AVAILABLE: CounterRead.ok({"": 6 * GIB}),
    pdh.PROCESSOR_TIME: CounterRead.failed(pdh.PDH_INVALID_DATA),
}  # a rate: no value yet
SECOND = {
    pdh.MEMORY_AVAILABLE: CounterRead.ok({"": 5 * GIB}),
    pdh.PROCESSOR_TIME: CounterRead.ok({"_Total": 37.5}),
}


@pytest.fixture
def no_proc(monkeypatch):
    """Fail the test if anything opens, lists or reads a /proc path."""
    touched: list[str] = []
    real_open, real_listdir = builtins.open, os.listdir

    def guard(path, *a, **kw):
        if str(path).startswith("/proc"):
            touched.append(str(path))
        return real_open(path, *a, **kw)

    def guard_listdir(path="."):
        if str(path).startswith("/proc"):
            touched.append(str(path))
        return real_listdir(path)

    monkeypatch.setattr(builtins, "open", guard)
    monkeypatch.setattr(os, "listdir", guard_listdir)
    yield touched
    assert touched == [], f"read /proc on a system without it: {touched}"


def _unknown_not_zero(r, reason: Reason = Reason.NOT_SUPPORTED) -> None:
    assert r.value is None and r.reason is reason and r.detail


def test_pdh_mocked_windows_host_sample_reads_pdh_never_proc(no_proc) -> None:
    fake = FakePdh(FIRST, SECOND)
    s = hostplat.PlatformHostSampler("win32", pdh=fake)
    first = s.sample()
    assert fake.asked == list(pdh.HOST_COUNTERS)
    assert first.memory.available_bytes.value == 6 * GIB
    assert first.memory.available_bytes.source == r"pdh:\Memory\Available Bytes"
    _unknown_not_zero(first.memory.total_bytes)
    _unknown_not_zero(first.memory.used_bytes, Reason.UNAVAILABLE)  # needs the total
    # % Processor Time is a rate: the first collection has none, and says so
    _unknown_not_zero(first.cpu.percent, Reason.UNAVAILABLE)
    assert first.cpu.percent.detail == "a rate: needs two samples"
    for load in (first.cpu.load_1, first.cpu.load_5, first.cpu.load_15):
        _unknown_not_zero(load)
        assert "no load average" in (load.detail or "")
    second = s.sample()
    assert second.cpu.percent.value == 37.5 and second.memory.available_bytes.value == 5 * GIB
    # no process list, swap devices or totals: unknown with a reason, never empty-as-zero
    assert dict(first.processes) == {} and "Windows" in (first.processes_reason or "")
    assert first.swap.devices is None and first.swap.devices_reason
    _unknown_not_zero(first.swap.used_bytes)
    s.close()
    assert fake.closed


def test_pdh_mocked_counter_failures_and_odd_instances_are_reasons() -> None:
    bad = {
        pdh.MEMORY_AVAILABLE: CounterRead.failed(pdh.PDH_CSTATUS_NO_COUNTER),
        pdh.PROCESSOR_TIME: CounterRead.ok({"a": 1.0, "b": 2.0}),
    }
    got = hostplat.PlatformHostSampler("win32", pdh=FakePdh(bad)).sample()
    _unknown_not_zero(got.memory.available_bytes)  # no such counter: not supported
    _unknown_not_zero(got.cpu.percent, Reason.QUERY_FAILED)
    assert "2 instances" in (got.cpu.percent.detail or "")


def test_real_pdh_on_this_linux_machine_is_a_reason_not_a_crash(no_proc) -> None:
    """The real CtypesPdh refuses to load off Windows: every PDH field says why."""
    got = hostplat.PlatformHostSampler("win32").sample()
    for r in (got.memory.available_bytes, got.cpu.percent):
        _unknown_not_zero(r, Reason.QUERY_FAILED)
        assert "only on Windows" in (r.detail or "")


def test_iokit_mocked_macos_host_sample_total_and_load(no_proc) -> None:
    s = hostplat.PlatformHostSampler(
        "darwin", memsize=lambda: 32 * GIB, loadavg=lambda: (1.5, 1.0, 0.5)
    )
    got = s.sample()
    assert got.memory.total_bytes.value == 32 * GIB
    assert got.memory.total_bytes.source == "sysctl:hw.memsize"
    assert [r.value for r in (got.cpu.load_1, got.cpu.load_5, got.cpu.load_15)] == [1.5, 1.0, 0.5]
    _unknown_not_zero(got.memory.available_bytes)
    _unknown_not_zero(got.cpu.percent)
    assert "macOS" in (got.processes_reason or "")
    failed = hostplat.PlatformHostSampler("darwin", memsize=lambda: None).sample()
    _unknown_not_zero(failed.memory.total_bytes, Reason.QUERY_FAILED)


@pytest.mark.parametrize("plat", ["win32", "darwin"])
def test_platform_samples_keep_the_null_rules_in_json_text_and_metrics(plat) -> None:
    s = hostplat.PlatformHostSampler(plat, pdh=FakePdh(SECOND), memsize=lambda: 16 * GIB)
    info = s.sample()
    assert report.null_rule_violations({"system": system_json(info)}) == []
    lines = text_report.system_lines(info)
    assert any("n/a (not supported)" in line for line in lines)
    assert any("devices n/a (swap devices are not read" in line for line in lines)
    names = {m.name for m in system_families(info)}
    exported = {n for n in names if n.startswith("gputaskman_system_memory")}
    # only what was measured is a series: Windows available bytes, macOS total
    assert exported == (
        {"gputaskman_system_memory_available_bytes"}
        if plat == "win32"
        else {"gputaskman_system_memory_total_bytes"}
    )
    doc = report.to_json_dict(__import__("mocked_snapshots").snapshot(), info)
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert doc["system"]["memory"]["free_bytes"]["value"] is None


def test_default_sampler_picks_by_platform_and_the_collector_uses_it(monkeypatch) -> None:
    assert isinstance(hostplat.default_sampler("linux"), host.HostSampler)
    for plat in ("win32", "darwin"):
        assert isinstance(hostplat.default_sampler(plat), hostplat.PlatformHostSampler)
    with pytest.raises(ValueError):
        hostplat.PlatformHostSampler("linux")

    class NoGpu(GpuSource):
        def sample(self):
            return GpuSample("nvml")

        def close(self) -> None:
            pass

    class NoScan:
        gives_procinfo = False

        def scan(self, keys, budget):
            return {}

    monkeypatch.setattr(sys, "platform", "darwin")
    c = collector.Collector(source=NoGpu(), scanner=NoScan(), models=None)
    monkeypatch.undo()
    snap, system = c.sample_with_system()
    assert isinstance(system, host.SystemInfo) and "macOS" in (system.processes_reason or "")
    assert snap.taken <= time.time()
