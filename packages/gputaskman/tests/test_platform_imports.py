"""Every platform module imports (and its backend constructs) on Linux without loading a
Windows or macOS library; backend selection; the probe outcome type; the platform table."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gputaskman.backends.registry import (
    BACKENDS,
    PLATFORM_TABLE,
    detect_backend,
    gpu_source,
    is_wsl,
)
from gputaskman.base.gpusource import GpuSample, ProbeResult
from gputaskman.base.readings import Problem, Reason
from gputaskman.sampling.collector import Collector, NullScanner

PLATFORM_MODULES = [
    "gputaskman.backends.registry",
    "gputaskman.backends.win",
    "gputaskman.backends.win.dxgi",
    "gputaskman.backends.win.pdh",
    "gputaskman.backends.win.tcc",
    "gputaskman.backends.win.backend",
    "gputaskman.backends.wsl",
    "gputaskman.backends.wslhost",
    "gputaskman.backends.macos",
    "gputaskman.backends.ascend",
]

# Records every shared library ctypes is asked to load, then imports the modules and
# builds the Windows and macOS backends (construction must not load anything either).
PROBE = """
import ctypes, importlib, json, sys
loaded = []
real_init = ctypes.CDLL.__init__
def spy(self, name, *a, **k):
    loaded.append(str(name))
    return real_init(self, name, *a, **k)
ctypes.CDLL.__init__ = spy
for m in MODULES:
    importlib.import_module(m)
from gputaskman.backends.registry import gpu_source
built = [type(gpu_source(b)).__name__ for b in ("wddm", "metal")]
print(json.dumps({"loaded": loaded, "built": built,
                  "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                                    ("pynvml", "textual", "rich", "winreg", "_winapi"))}))
"""


def test_platform_modules_import_and_construct_on_linux_without_loading_libraries():
    if not sys.platform.startswith("linux"):
        pytest.skip("this checks the Linux import path")
    code = PROBE.replace("MODULES", repr(PLATFORM_MODULES))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    doc = json.loads(out.stdout)
    assert doc["built"] == ["WddmBackend", "MacCounters"]
    assert doc["loaded"] == [], f"libraries loaded at import/construction: {doc['loaded']}"
    assert doc["modules"] == []  # no NVML binding, no UI library, no Windows module


def test_the_spy_sees_a_load():
    code = PROBE.replace("MODULES", "[]") + "\nctypes.CDLL(None)\nprint(json.dumps(loaded))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == '["None"]'  # so an empty list above means it


@pytest.mark.parametrize(
    ("plat", "release", "env", "want"),
    [
        ("win32", "10", {}, "wddm"),
        ("cygwin", "3.5", {}, "wddm"),
        ("darwin", "24.0.0", {}, "metal"),
        ("linux", "5.15.153.1-microsoft-standard-WSL2", {}, "wsl"),
        ("linux", "4.4.0-19041-Microsoft", {}, "wsl"),
        ("linux", "6.8.0", {"WSL_DISTRO_NAME": "Ubuntu"}, "wsl"),
        ("linux", "6.18.0-amd64", {}, "nvml"),
        ("freebsd14", "14.0", {}, "nvml"),
    ],
)
def test_backend_is_chosen_from_platform_facts(plat, release, env, want):
    assert detect_backend(plat, release, env) == want


def test_is_wsl_needs_a_sign():
    assert not is_wsl("6.1.0-18-amd64", {"WSL_DISTRO_NAME": ""})


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown backend"):
        gpu_source("cuda")
    facts = [("win32", ""), ("darwin", ""), ("linux", "5.15-microsoft"), ("linux", "6.1")]
    assert {detect_backend(p, r, {}) for p, r in facts} == set(BACKENDS)  # all registered


def test_probe_result_keeps_empty_and_failed_apart():
    assert ProbeResult.of("x", (), None).status == "empty"
    p = Problem("backend.init", Reason.NO_LIBRARY, "nvml.dll not found")
    failed = ProbeResult.of("x", (), p)
    assert failed.status == "failed" and failed.reason is Reason.NO_LIBRARY
    assert failed.line() == "x: probe failed (library not found: nvml.dll not found)"
    partial = ProbeResult.of("x", (), None, (Problem("processes.pdh", Reason.DENIED),))
    assert (
        partial.line()
        == "x: probe succeeded, 0 GPUs (incomplete: some queries failed, see problems)"
    )
    with pytest.raises(ValueError):
        ProbeResult("x", "failed")
    with pytest.raises(ValueError):
        ProbeResult("x", "ok", 0)
    with pytest.raises(ValueError):
        ProbeResult("x", "empty", 2)


@pytest.mark.parametrize("backend", ["wddm", "metal"])
def test_foreign_backend_on_linux_degrades_with_a_reason(backend):
    source = gpu_source(backend)
    if backend == "wddm":
        from gputaskman.backends.win.backend import WddmBackend

        source = WddmBackend(tcc=False)
    snap = Collector(source=source, scanner=NullScanner()).sample()
    assert not snap.available and snap.backend_problem is not None
    assert "only" in (snap.backend_problem.detail or "")  # "... only on Windows/macOS"


def test_platform_table_is_honest():
    backends = {row[1] for row in PLATFORM_TABLE}
    assert {"wddm", "tcc", "wsl", "metal", "ascend"} <= backends
    for platform, _backend, measures, validated in PLATFORM_TABLE:
        assert platform and measures
        assert validated.startswith("not validated"), platform


def test_probes_list_the_main_probe_then_sub_probes():
    from gputaskman.backends.win.backend import WddmBackend
    from gputaskman.backends.win.pdh import COUNTERS, CounterRead
    from gputaskman.backends.win.tcc import TccCounters

    class NoAdapters:
        def enum_adapters(self):
            return []

    class EmptyPdh:
        def read(self, paths):
            return {p: CounterRead.ok({}) for p in COUNTERS}

        def close(self):
            pass

    def no_nvml():
        raise FileNotFoundError(r"nvml.dll not found at C:\Windows\System32\nvml.dll")

    w = WddmBackend(dxgi=NoAdapters(), pdh=EmptyPdh(), tcc=TccCounters(loader=no_nvml))
    import unittest.mock

    with unittest.mock.patch("sys.platform", "win32"):
        s = w.sample()
    main, tcc = s.probes
    assert main.line() == "wddm: probe succeeded, 0 GPUs"
    assert tcc.status == "failed" and "nvml.dll not found" in tcc.line()
    p = Problem("backend.init", Reason.NO_LIBRARY, "NVML Shared Library Not Found")
    (only,) = GpuSample("nvml", problems=(p,), backend_problem=p).probes
    assert only.line() == "nvml: probe failed (library not found: NVML Shared Library Not Found)"
