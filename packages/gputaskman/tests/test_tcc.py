"""NVIDIA TCC/MCDM GPUs on Windows, through a mocked NVML (no GPU, no Windows here).

Reuses `MockedNvml` from test_nvml_mocked.py (pynvml-shaped answers, the binding's real
exception classes) and adds the driver-model call. Mocks do not validate TCC hardware.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pynvml
import pytest
from gputaskman.backends.win import pdh
from gputaskman.backends.win.backend import WddmBackend
from gputaskman.backends.win.dxgi import AdapterDesc
from gputaskman.backends.win.pdh import CounterRead
from gputaskman.backends.win.tcc import (
    NVML_DRIVER_MCDM,
    NVML_DRIVER_WDDM,
    NVML_DRIVER_WDM,
    TccCounters,
    load_windows_nvml,
    pair_with_dxgi,
    parse_bus_id,
)
from gputaskman.base import schema
from gputaskman.base.readings import Reason
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner

GIB = 1024**3


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


nv = _load("test_nvml_mocked")


class DriverModelNvml(nv.MockedNvml):
    """MockedNvml plus nvmlDeviceGetCurrentDriverModel (per-device "model", WDDM default)."""

    def __init__(self, devices, **kw):
        super().__init__(devices, **kw)
        self.model_calls = 0

    def nvmlDeviceGetCurrentDriverModel(self, h: int) -> int:
        self.model_calls += 1
        return self._answer(self.devices[h].get("model", NVML_DRIVER_WDDM))


TCC_BUS = "00000000:3b:00.0"
WDDM_BUS = "00000000:01:00.0"


def tcc_device(bus: str = TCC_BUS, model: int = NVML_DRIVER_WDM, **kw):
    return nv.device(bus, name="NVIDIA Mock A100", model=model, **kw)


def desc(low: int, pci=(1, 0, 0)) -> AdapterDesc:
    return AdapterDesc("NVIDIA Mock RTX", 0x10DE, 0x2704, 0, 0xA1, 16 * GIB, 0, 0, 0, low, pci=pci)


class Dxgi:
    def __init__(self, *steps):
        self.steps = list(steps)

    def enum_adapters(self):
        return list(self.steps.pop(0) if len(self.steps) > 1 else self.steps[0])


class EmptyPdh:
    def read(self, paths):
        return {p: CounterRead.ok({}) for p in pdh.COUNTERS}

    def close(self):
        pass


def test_tcc_mocked_keeps_tcc_and_mcdm_devices_only_and_asks_the_model_once():
    lib = DriverModelNvml(
        [
            nv.device(WDDM_BUS),  # a WDDM GPU: DXGI and PDH cover it
            tcc_device(),
            tcc_device("00000000:af:00.0", model=NVML_DRIVER_MCDM),
        ]
    )
    t = TccCounters(lib)
    s = t.sample()
    assert [(a.pci_bus_id, a.backend) for a in s.adapters] == [
        (TCC_BUS, "tcc"),
        ("00000000:af:00.0", "tcc"),
    ]
    assert t.modes == {TCC_BUS: "tcc", "00000000:af:00.0": "mcdm"}
    assert WDDM_BUS not in s.metrics and all(p.adapter != WDDM_BUS for p in s.processes)
    t.sample()
    t.sample()
    assert lib.model_calls == 3  # once per device, not once per sample
    assert lib.init_calls == 1
    assert s.probe.status == "ok" and s.probe.count == 2


def test_tcc_mocked_hidden_process_memory_is_na_never_zero():
    dev = tcc_device(compute=[nv.proc(500, None), nv.proc(501, 3 * GIB), nv.proc(502, 0)])
    s = TccCounters(DriverModelNvml([dev])).sample()
    by = {p.pid: p.dedicated for p in s.processes}
    assert by[500].value is None and by[500].reason is Reason.HIDDEN
    assert by[501].value == 3 * GIB and by[502].value == 0


def test_tcc_mocked_appended_after_dxgi_and_no_index_moves():
    lib = DriverModelNvml([tcc_device(compute=[nv.proc(500, None), nv.proc(501, 3 * GIB)])])
    a, b, c = desc(0xA, pci=(1, 0, 0)), desc(0xB, pci=(2, 0, 0)), desc(0xC, pci=(4, 0, 0))
    backend = WddmBackend(dxgi=Dxgi([a, b], [a, b, c]), pdh=EmptyPdh(), tcc=TccCounters(lib))
    s1 = backend.sample()
    assert [(x.index, x.pci_bus_id, x.backend) for x in s1.adapters] == [
        (0, a.luid, "wddm"),
        (1, b.luid, "wddm"),
        (2, TCC_BUS, "tcc"),
    ]
    s2 = backend.sample()  # a new DXGI adapter appears later: it gets the next index
    assert [(x.index, x.pci_bus_id) for x in s2.adapters] == [
        (0, a.luid),
        (1, b.luid),
        (2, TCC_BUS),
        (3, c.luid),
    ]
    assert s2.metrics[TCC_BUS].memory_total_bytes.value == 16 * GIB
    assert any("NVML only" in n for n in s2.notes)
    snap = Collector(source=backend, scanner=NullScanner()).sample()
    # the hidden process makes the TCC sum a lower bound, never a complete-looking number
    assert snap.attributed_on(TCC_BUS) == 3 * GIB
    assert snap.attributed_complete_on(TCC_BUS) is False
    assert report.null_rule_violations(report.to_json_dict(snap, None)) == []
    assert schema.errors(report.to_json_dict(snap, None)) == []  # the packaged JSON Schema


def test_tcc_mocked_paired_only_when_pci_address_is_unambiguous():
    lib = DriverModelNvml(
        [
            tcc_device("00000000:01:00.0"),
            tcc_device("00000001:02:00.0"),
            tcc_device("00000000:05:00.0"),
        ]
    )
    dxgi_adapters = [
        desc(0xA, pci=(1, 0, 0)),
        desc(0xB, pci=(2, 0, 0)),
        desc(0xC, pci=(5, 0, 0)),
        desc(0xD, pci=(5, 0, 0)),
    ]
    s = WddmBackend(dxgi=Dxgi(dxgi_adapters), pdh=EmptyPdh(), tcc=TccCounters(lib)).sample()
    keys = [x.pci_bus_id for x in s.adapters]
    # 01:00.0 in domain 0 is exactly one DXGI adapter: the same GPU, listed once
    assert "00000000:01:00.0" not in keys
    assert any("is DXGI adapter 0" in n for n in s.notes)
    # domain 1 cannot be compared with DXGI's domainless address: listed on its own
    assert "00000001:02:00.0" in keys
    assert any("PCI domain 1" in n for n in s.notes)
    # two DXGI adapters claim 05:00.0: ambiguous, not paired
    assert "00000000:05:00.0" in keys
    assert [x.index for x in s.adapters] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    ("bus", "dxgi", "want"),
    [
        ("00000000:01:00.0", ["01:00.0"], 0),
        ("0000:01:00.0", [None, "01:00.0"], 1),
        ("00000000:01:00.0", ["01:00.0", "01:00.0"], None),
        ("00000002:01:00.0", ["01:00.0"], None),
        ("00000000:01:00.0", [None], None),
        ("garbage", ["01:00.0"], None),
    ],
)
def test_pair_with_dxgi_rules(bus, dxgi, want):
    assert pair_with_dxgi(bus, dxgi) == want


def test_parse_bus_id():
    assert parse_bus_id("00000001:3B:00.1") == (1, 0x3B, 0, 1)
    assert parse_bus_id("3b:00.0") is None and parse_bus_id("") is None


def test_tcc_mocked_no_nvidia_driver_is_a_failed_probe_not_an_empty_one(monkeypatch):
    monkeypatch.setattr("sys.platform", "win32")

    def loader():
        raise FileNotFoundError(r"nvml.dll not found at C:\Windows\System32\nvml.dll")

    t = TccCounters(loader=loader)
    s = t.sample()
    assert s.probe.status == "failed" and s.probe.reason is Reason.NO_LIBRARY
    assert "nvml.dll" in s.probe.line()
    # inside the Windows backend a machine without NVIDIA is normal: no problem is raised
    w = WddmBackend(dxgi=Dxgi([desc(0xA)]), pdh=EmptyPdh(), tcc=TccCounters(loader=loader))
    ws = w.sample()
    assert ws.problems == () and [a.index for a in ws.adapters] == [0]
    (tcc,) = ws.parts  # TCC's own probe, for --list-gpus
    assert tcc.backend == "tcc" and tcc.status == "failed"


def test_tcc_mocked_nvml_with_only_wddm_gpus_is_an_empty_probe():
    s = TccCounters(DriverModelNvml([nv.device(WDDM_BUS)])).sample()
    assert s.probe.status == "empty" and s.backend_problem is None


def test_tcc_mocked_nvml_init_failure_is_failed_with_reason():
    lib = DriverModelNvml([], init_error=pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    s = TccCounters(lib).sample()
    assert s.probe.status == "failed" and s.probe.reason is Reason.NO_DRIVER


def test_tcc_off_windows_without_a_library_is_not_supported():
    s = TccCounters().sample()
    assert s.probe.status == "failed" and s.probe.reason is Reason.NOT_SUPPORTED


def test_windows_nvml_is_loaded_by_absolute_path_only():
    with pytest.raises(FileNotFoundError):
        load_windows_nvml(exists=lambda p: True, dll_path="nvml.dll")  # bare name: refused
    with pytest.raises(FileNotFoundError, match="no NVIDIA driver"):
        load_windows_nvml(exists=lambda p: False, dll_path=r"C:\Windows\System32\nvml.dll")
