"""One contract, every backend: each GPU backend runs over its mocks or fixture trees through
the same checks (`base.gpusource`).

There is no GPU, Windows, WSL, Mac or Ascend NPU here. NVML answers come from the mocked
pynvml of test_nvml_mocked.py, TCC's from test_tcc.py's, PDH and DXGI from test_win_pdh.py's
fakes, IOKit and the footprint calls from test_macos.py's, the WSL host stream from
test_wsl.py's synthetic replay, ``npu-smi`` from its recorded-format tables (printed by a
real ``cat``), and DRM reads a fixture tree (`fixtures.drm_fixtures`). The checks:

* every sample, adapter, device and process is of the contract's types, and every reading's
  kind, value and reason agree (measured per-process memory, inferred only where inferred);
* what a mock makes unknown (hidden memory, an unsupported sensor, a rate's first sample) is
  None with a reason, never 0; a failed backend lists nothing at all;
* notes and probe results are there and agree with the sample; every GPU names its backend;
* ``close()`` can be called twice;
* the collector needs nothing but the protocol: a wrapper that hides everything else gives
  the same snapshot, which passes the JSON Schema and the null rule.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import pkgutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import gputaskman.backends
import pynvml
import pytest
from gputaskman.backends.ascend import AscendBackend
from gputaskman.backends.drm import DrmBackend
from gputaskman.backends.linux import LinuxGpus, NotAsked
from gputaskman.backends.macos import MacCounters
from gputaskman.backends.nvml import NvmlBackend
from gputaskman.backends.registry import sysroot_gpu_source
from gputaskman.backends.win.backend import WddmBackend
from gputaskman.backends.win.dxgi import AdapterDesc
from gputaskman.backends.win.tcc import NVML_DRIVER_MCDM, TccCounters
from gputaskman.backends.wsl import Interop, WslBackend
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource, ProbeResult
from gputaskman.base.readings import Adapter, DeviceMetrics, Kind, Problem, Reading, Reason
from gputaskman.fixtures.drm_fixtures import AMD_PDEV, write_demo_tree
from gputaskman.render import report
from gputaskman.sampling.collector import Collector, NullScanner
from gputaskman.sampling.host import HostSampler
from gputaskman.sampling.procfacts import RowFacts

HERE = Path(__file__).parent
GIB = 1024**3
MIB = 1024**2
#: The names a GPU's `Adapter.backend` may carry.
ADAPTER_BACKENDS = {"nvml", "drm", "ascend", "wddm", "tcc", "wsl-host", "metal"}


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"contract_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


nv = _load("test_nvml_mocked")
tcc = _load("test_tcc")
pdh = _load("test_win_pdh")
mac = _load("test_macos")
wsl = _load("test_wsl")


# -- the backends, each over its mocks --------------------------------------------------------


def ticks(step: int) -> Callable[[], int]:
    """A clock that advances `step` per call (rates need time to pass between samples)."""
    counter = itertools.count(1)
    return lambda: next(counter) * step


def nvml_mocked() -> NvmlBackend:
    """Two GPUs: one lists a process whose memory NVML hides; the other has no temperature
    sensor and refuses its compute process list."""
    ok = nv.device(nv.BUS_A, compute=[nv.proc(100, 8 * GIB), nv.proc(101, None)])
    refused = nv.device(
        nv.BUS_B,
        compute=pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION),
        temperature=pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED),
    )
    return NvmlBackend(nv.MockedNvml([ok, refused]))


def nvml_missing() -> NvmlBackend:
    lib = nv.MockedNvml([], init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    return NvmlBackend(lib)


def wddm_desc() -> AdapterDesc:
    return AdapterDesc("NVIDIA Mock RTX", 0x10DE, 0x2704, 0, 0xA1, 16 * GIB, 0, 0, 0, 0xD1A2)


def tcc_mocked() -> TccCounters:
    """A WDDM GPU (left to DXGI), a TCC GPU hiding a process's memory, an MCDM GPU."""
    return TccCounters(
        tcc.DriverModelNvml(
            [
                nv.device(tcc.WDDM_BUS),
                tcc.tcc_device(compute=[nv.proc(500, None), nv.proc(501, 3 * GIB)]),
                tcc.tcc_device("00000000:af:00.0", model=NVML_DRIVER_MCDM),
            ]
        )
    )


class BrokenDxgi:
    def enum_adapters(self) -> list[AdapterDesc]:
        raise OSError("DXGI: CreateDXGIFactory1 failed (0x887A0004)")


def wsl_replay(nvml: GpuSource) -> WslBackend:
    """vmwp.exe idle at 300 MiB, then at 4396 MiB once a Linux process holds /dev/dxg."""
    host = wsl.ReplayHost(
        wsl.frame(1, 300 * MIB, {4: 50 * MIB}) + wsl.frame(2, 4396 * MIB, {4: 50 * MIB})
    )
    calls = itertools.count()
    holder = {wsl.A[0]: wsl.A}
    return WslBackend(
        nvml=nvml,
        host=host,
        interop=Interop(True, None, "/mnt/c/ps.exe"),
        holders=lambda: ({} if next(calls) == 0 else holder, 0),
    )


def metal_mocked() -> MacCounters:
    """Own-user process with GPU time; another user's, whose footprint is refused."""
    clients = [mac.client(mac.OWN, "llama-server", 10**9), mac.client(mac.OTHER, "Finder", None)]
    return MacCounters(
        iokit=mac.FakeIOKit([mac.agx(clients)]),
        footprint=mac.FakeFootprint(root=False),
        memsize=lambda: 16 * GIB,
        clock=ticks(1),
    )


def npu_smi(table: str) -> AscendBackend:
    return AscendBackend(["cat", str(HERE / "npu_smi" / table)])


def npu_smi_failing() -> AscendBackend:
    fail = (
        "import sys; sys.stderr.write('dcmi model initialized failed, ret is -8020\\n'); exit(255)"
    )
    return AscendBackend([sys.executable, "-c", fail])


def procs(s: GpuSample, pid: int, host: str | None = None) -> list[GpuProcess]:
    return [p for p in s.processes if p.pid == pid and p.host == host]


@dataclass(frozen=True)
class Case:
    """One backend over one set of mocks. `build(tree)` makes a fresh source (`tree` is a
    DRM fixture tree); `unknown(sample)` picks the readings the mocks made unknown."""

    name: str
    kind: type
    build: Callable[[Path], GpuSource]
    unknown: Callable[[GpuSample], Sequence[Reading | None]] | None = None
    samples: int = 2
    failed: bool = False


CASES = [
    Case(
        "nvml",
        NvmlBackend,
        lambda tree: nvml_mocked(),
        lambda s: [
            *(p.dedicated for p in procs(s, 101)),
            s.metrics[nv.BUS_B.lower()].temperature_c,
        ],
    ),
    Case("nvml, no library", NvmlBackend, lambda tree: nvml_missing(), failed=True),
    Case(
        "drm (amdgpu, i915)",
        DrmBackend,
        lambda tree: DrmBackend(str(tree), clock_ns=ticks(10**9)),
        lambda s: [p.dedicated for p in procs(s, 4300)],  # a client shared by two processes
    ),
    Case("drm, no card", DrmBackend, lambda tree: DrmBackend(str(tree / "no-such-root"))),
    Case(
        "linux: nvml + drm + ascend",
        LinuxGpus,
        lambda tree: LinuxGpus(nvml_mocked(), DrmBackend(str(tree)), npu_smi("single.txt")),
        lambda s: [*(p.dedicated for p in procs(s, 101)), *(p.dedicated for p in procs(s, 4300))],
    ),
    Case(
        "linux, no nvml, failing npu-smi",
        LinuxGpus,
        lambda tree: LinuxGpus(nvml_missing(), DrmBackend(str(tree)), npu_smi_failing()),
        lambda s: [p.dedicated for p in procs(s, 4300)],
    ),
    Case(
        "sysroot fixture source (NVML not asked)",
        LinuxGpus,
        lambda tree: sysroot_gpu_source(str(tree)),
        lambda s: [p.dedicated for p in procs(s, 4300)],
    ),
    Case("nvml not asked", NotAsked, lambda tree: NotAsked("nvml", "not asked"), failed=True),
    Case(
        "ascend (dual die)",
        AscendBackend,
        lambda tree: npu_smi("dual_die.txt"),
        lambda s: [s.metrics["00000000:9e:00.0"].power_w],  # npu-smi prints '-'
    ),
    Case("ascend, npu-smi fails", AscendBackend, lambda tree: npu_smi_failing(), failed=True),
    Case(
        "wddm + tcc",
        WddmBackend,
        lambda tree: WddmBackend(
            dxgi=pdh.FakeDxgi([wddm_desc()]), pdh=pdh.FakePdh(pdh.reads()), tcc=tcc_mocked()
        ),
        lambda s: [
            s.metrics[pdh.LUID_A].temperature_c,  # not a PDH counter
            *(p.dedicated for p in procs(s, 500)),  # TCC: NVML hides it
        ],
    ),
    Case(
        "wddm, dxgi fails",
        WddmBackend,
        lambda tree: WddmBackend(dxgi=BrokenDxgi(), pdh=pdh.FakePdh(pdh.reads()), tcc=False),
        failed=True,
    ),
    Case(
        "tcc",
        TccCounters,
        lambda tree: tcc_mocked(),
        lambda s: [p.dedicated for p in procs(s, 500)],
    ),
    Case(
        "wsl: host stream, no nvml",
        WslBackend,
        lambda tree: wsl_replay(nvml_missing()),
        # the Linux process's bytes are counted under vmwp.exe: its own are unknown
        lambda s: [p.dedicated for p in procs(s, wsl.A[0])],
    ),
    Case(
        "wsl, interop off",
        WslBackend,
        lambda tree: WslBackend(
            nvml=nvml_mocked(),
            interop=Interop(False, "WSL interop is off"),
            holders=lambda: ({}, 0),
        ),
        lambda s: [*(p.dedicated for p in procs(s, 101))],
    ),
    Case(
        "metal",
        MacCounters,
        lambda tree: metal_mocked(),
        lambda s: [
            *(p.footprint for p in procs(s, mac.OTHER)),  # another user's: refused
            *(p.dedicated for p in procs(s, mac.OWN)),  # graphics ledger needs root
            *(p.engines["gpu_percent"] for p in procs(s, mac.OTHER)),  # publishes no GPU time
        ],
    ),
    Case(
        "metal, iokit fails",
        MacCounters,
        lambda tree: MacCounters(
            iokit=mac.FakeIOKit(OSError("IOServiceGetMatchingServices returned 0xe00002c7")),
            footprint=mac.FakeFootprint(),
            memsize=lambda: None,
        ),
        failed=True,
    ),
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("drm") / "root"
    write_demo_tree(root)
    return root


# -- the checks ----------------------------------------------------------------------------------


def readings(s: GpuSample) -> Iterator[tuple[str, Reading, set[Kind]]]:
    """Every reading of a sample, where it sits, and the kinds it may have there."""
    device = {Kind.MEASURED, Kind.INFERRED}  # Intel "used" is a sum over visible clients
    for bus, m in s.metrics.items():
        for name in DeviceMetrics.__slots__:
            yield f"metrics[{bus}].{name}", getattr(m, name), device
    for bus, extra in s.extra_metrics.items():
        for name, r in extra.items():
            yield f"extra_metrics[{bus}].{name}", r, {Kind.MEASURED}
    for p in s.processes:
        where = f"process {p.pid}@{p.adapter}"
        yield f"{where}.dedicated", p.dedicated, {Kind.MEASURED}
        for name, r in p.engines.items():
            yield f"{where}.engines[{name}]", r, {Kind.MEASURED}
        for name, r, kinds in (
            ("paged", p.paged, {Kind.MEASURED}),
            ("footprint", p.footprint, {Kind.MEASURED}),
            ("inferred", p.inferred, {Kind.INFERRED}),
        ):
            if r is not None:
                yield f"{where}.{name}", r, kinds


def contract_violations(s: object, source: GpuSource) -> list[str]:
    """Every way `s` (what `source.sample()` returned) breaks the contract."""
    if not isinstance(s, GpuSample):
        return [f"sample is a {type(s).__name__}, not a GpuSample"]
    bad: list[str] = []
    if not s.backend:
        bad.append("the sample names no backend")
    keys = [a.pci_bus_id for a in s.adapters]
    for a in s.adapters:
        if not isinstance(a, Adapter):
            bad.append(f"adapter {a!r} is not an Adapter")
        elif a.backend not in ADAPTER_BACKENDS:
            bad.append(f"GPU {a.index} names backend {a.backend!r}")
        elif not a.vendor or not a.pci_bus_id:
            bad.append(f"GPU {a.index} has no vendor or key")
    if len(set(keys)) != len(keys) or len({a.index for a in s.adapters}) != len(keys):
        bad.append(f"adapters repeat a key or an index: {s.adapters}")
    if set(s.metrics) != set(keys):
        bad.append(f"metrics for {sorted(s.metrics)}, adapters {sorted(keys)}")
    bad += [
        f"{b}: not a DeviceMetrics" for b, m in s.metrics.items() if type(m) is not DeviceMetrics
    ]
    bad += [f"extra metrics of unlisted {b}" for b in s.extra_metrics if b not in keys]
    for where, r, kinds in readings(s):
        if not isinstance(r, Reading):
            bad.append(f"{where}: {r!r} is not a Reading")
        elif (r.value is None) != (r.reason is not None) or isinstance(r.value, bool):
            bad.append(f"{where}: value {r.value!r} with reason {r.reason!r}")
        elif r.kind not in kinds:
            bad.append(f"{where}: kind {r.kind}, expected one of {sorted(kinds)}")
        elif r.reason is not None and not isinstance(r.reason, Reason):
            bad.append(f"{where}: reason {r.reason!r} is not a Reason")
    for p in s.processes:
        if not isinstance(p, GpuProcess):
            bad.append(f"process {p!r} is not a GpuProcess")
        elif p.adapter not in keys:
            bad.append(f"process {p.pid} sits on unlisted adapter {p.adapter}")
        elif not p.contexts or not isinstance(p.unique, bool) or p.host not in (None, "windows"):
            bad.append(f"process {p.pid}: contexts {p.contexts}, unique {p.unique}, host {p.host}")
    for pr in s.problems:
        if not isinstance(pr, Problem) or not isinstance(pr.reason, Reason):
            bad.append(f"problem {pr!r}")
        elif pr.adapter is not None and pr.adapter not in keys:
            bad.append(f"problem {pr.where} about unlisted adapter {pr.adapter}")
    if not isinstance(s.notes, tuple) or not all(isinstance(n, str) and n for n in s.notes):
        bad.append(f"notes {s.notes!r}")
    if not all(isinstance(pr, ProbeResult) for pr in s.probes):
        bad.append(f"probes {s.probes!r}")
    elif s.probe.backend != s.backend or (s.probe.status == "failed") != (
        s.backend_problem is not None
    ):
        bad.append(f"probe {s.probe} disagrees with the sample")
    if s.backend_problem is not None and (s.adapters or s.processes or s.metrics):
        bad.append("a backend that could not answer lists GPUs or processes")
    for selected in (None, *(a.index for a in s.adapters)):
        name = source.backend_for(s, selected)
        if not isinstance(name, str) or not name:
            bad.append(f"backend_for({selected}) is {name!r}")
    return bad


class OnlyTheContract(GpuSource):
    """A source that shows the collector the protocol's methods and nothing else."""

    def __init__(self, inner: GpuSource) -> None:
        self._inner = inner

    def sample(self) -> GpuSample:
        return self._inner.sample()

    def close(self) -> None:
        self._inner.close()

    def backend_for(self, sample: GpuSample, selected: int | None) -> str:
        return self._inner.backend_for(sample, selected)


def snapshot_docs(source: GpuSource, n: int, gpu: int | None, tree: Path) -> list[dict[str, Any]]:
    """`n` snapshot documents of `source`, its processes looked up in the fixture tree's /proc,
    never this machine's: a live process on a mocked pid changes between two collectors (a
    kernel worker's name names the work it does: this comparison failed now and then with
    pid 100 a kworker)."""
    proc = str(tree / "proc")
    c = Collector(
        gpu,
        None,
        source=source,
        host=HostSampler(proc_root=proc),
        scanner=NullScanner(),
        models=None,
        facts=RowFacts(proc, pods_dir=str(tree / "no-pods"), swaps=str(tree / "proc" / "swaps")),
    )
    try:
        return [report.to_json_dict(c.sample(), None, selected_gpu=gpu) for _ in range(n)]
    finally:
        c.close()


IDS = [c.name for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backend_mocked_keeps_the_contract(case: Case, tree: Path) -> None:
    """Catches a backend that returns its own types, reports an unknown as 0, lists a
    process on a GPU it does not list, leaves a GPU without its backend's name, or whose
    close() fails the second time."""
    source = case.build(tree)
    assert isinstance(source, case.kind)
    try:
        samples = [source.sample() for _ in range(case.samples)]
    finally:
        source.close()
        source.close()  # idempotent
    unknown: list[Reading | None] = []
    for i, s in enumerate(samples):
        assert contract_violations(s, source) == [], f"sample {i}"
        assert (s.probe.status == "failed") == case.failed
        unknown += case.unknown(s) if case.unknown is not None else ()
    assert bool(unknown) == (case.unknown is not None)  # the selectors found their readings
    for r in unknown:
        # unknown is None with a reason, never 0
        assert r is not None and r.value is None and r.reason is not None, r


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_collector_mocked_needs_only_the_protocol(case: Case, tree: Path) -> None:
    """Catches a collector that reads a backend attribute the protocol does not declare
    (the snapshot through `OnlyTheContract` would differ, or raise)."""
    for gpu in (None, 1):
        direct = snapshot_docs(case.build(tree), case.samples, gpu, tree)
        wrapped = snapshot_docs(OnlyTheContract(case.build(tree)), case.samples, gpu, tree)
        for doc in wrapped:
            assert schema.errors(doc) == []  # the packaged JSON Schema
            assert report.null_rule_violations(doc) == []
            assert doc["available"] is not case.failed
        for doc in (*direct, *wrapped):
            del doc["taken"], doc["taken_iso"]
        assert wrapped == direct


def test_every_backend_class_has_a_contract_case() -> None:
    """Catches a new backend that is not run through the contract checks above."""
    pkg = gputaskman.backends
    for mod in pkgutil.walk_packages(pkg.__path__, f"{pkg.__name__}."):
        importlib.import_module(mod.name)  # every module imports on Linux (see platform tests)

    def subclasses(cls: type) -> set[type]:
        return {s for c in cls.__subclasses__() for s in {c, *subclasses(c)}}

    ours = {c for c in subclasses(GpuSource) if c.__module__.startswith("gputaskman.")}
    assert ours == {c.kind for c in CASES}


def test_linux_source_mocked_names_the_snapshot_by_the_gpu_shown(tree: Path) -> None:
    """Catches a `backend_for` that ignores the selected GPU: the Linux source is the one
    whose snapshot name depends on it (NVIDIA: nvml, AMD/Intel: drm, NPU: ascend)."""
    source = LinuxGpus(nvml_mocked(), DrmBackend(str(tree)), npu_smi("single.txt"))
    s = source.sample()
    by_backend = {a.backend: a.index for a in s.adapters}
    assert source.backend_for(s, None) == "nvml"  # NVIDIA first
    assert source.backend_for(s, by_backend["drm"]) == "drm"
    assert source.backend_for(s, by_backend["ascend"]) == "ascend"
    amd = next(a for a in s.adapters if a.pci_bus_id.endswith(AMD_PDEV[-7:]))
    assert amd.backend == "drm" and source.backend_for(s, amd.index) == "drm"
