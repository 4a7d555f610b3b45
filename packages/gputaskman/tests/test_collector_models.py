"""The collector's model step (`modelinfo`): GPU rows get ``other`` only from measured bytes
minus runtime-reported parts, estimates never reach a measured total, and background looks
never block a refresh.

Processes are real (the IMITATION llama-server of ``imitation_llama_server.py``, mapping a
real GGUF file written with the ``gguf`` package). There is no GPU here, so where a test
needs NVML to list a process, the NVML sample is a mock and the test name says so.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from gputaskman.base import schema
from gputaskman.base.gpusource import GpuProcess, GpuSample, GpuSource
from gputaskman.base.readings import Adapter, Kind, ProcGpu, Reading, Snapshot
from gputaskman.intel import gguf, llm
from gputaskman.intel.evidence import Evidence, Source, assess
from gputaskman.intel.modelinfo import ModelResolver
from gputaskman.intel.procinfo import scan_process
from gputaskman.intel.stores import StoreIndex, StoreRoots
from gputaskman.render import report, text_report
from gputaskman.sampling.collector import Collector, ProcinfoScanner

HERE = Path(__file__).resolve().parent
MIB = 1024 * 1024
GIB = 1024**3
BUS = "00000000:01:00.0"


def _load_helper(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_gtm_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


write_model = _load_helper("gguf_files").write_model

# llama.cpp's two passes (sizing with 0.00 MiB, then real) for a CUDA build (FACTS.md shape)
CUDA_LOG = """\
load_tensors:        CUDA0 model buffer size =     0.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =     0.00 MiB
sched_reserve:       CUDA0 compute buffer size =    20.00 MiB
load_tensors:        CUDA0 model buffer size =  1000.00 MiB
load_tensors:   CPU_Mapped model buffer size =    50.00 MiB
llama_kv_cache:      CUDA0 KV buffer size =   256.00 MiB
sched_reserve:       CUDA0 compute buffer size =   300.00 MiB
sched_reserve:   CUDA_Host compute buffer size =    12.00 MiB
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """The imitation without -v, its stderr a log that already holds CUDA buffer lines."""
    model = tmp_path / "tiny.gguf"
    write_model(model, "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=256)
    log = tmp_path / "server.log"
    log.write_text(CUDA_LOG)
    argv = [
        sys.executable,
        str(HERE / "imitation_llama_server.py"),
        "-m",
        "tiny.gguf",
        "--port",
        "0",
        "-c",
        "128",
    ]
    with open(log, "a") as err:
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout.readline().startswith("listening")
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


class MockNvml(GpuSource):
    """NVML mock: one NVIDIA GPU that lists `pid` with `vram` measured bytes."""

    def __init__(self, pid: int, vram: int) -> None:
        self.pid, self.vram = pid, vram

    def sample(self) -> GpuSample:
        a = Adapter(0, "nvidia", "NVIDIA Mock GPU", "GPU-mock", BUS, "nvml")
        p = GpuProcess(
            self.pid, BUS, ("compute",), Reading.measured(self.vram, "nvml:mock running processes")
        )
        return GpuSample("nvml", adapters=(a,), processes=(p,), driver_version="mock")

    def close(self) -> None:
        pass


def test_nvml_mocked_gpu_row_other_is_measured_minus_runtime_parts(server):
    vram = 2 * GIB
    c = Collector(scan_budget=None, source=MockNvml(server.pid, vram))
    try:
        snap, system = c.sample_with_system()
    finally:
        c.close()
    row = next(p for p in snap.processes if p.pid == server.pid)
    view = row.breakdown
    assert view is not None and row.model is not None and row.model.confirmed
    w, kv, comp, other = (view.part(n) for n in ("weights", "kv_cache", "compute", "other"))
    # CUDA0 only: the CPU_Mapped and CUDA_Host buffers are host memory, not this GPU's
    assert w.reading.kind is Kind.RUNTIME and w.reading.value == 1000 * MIB
    assert "(CUDA0)" in w.reading.source
    assert kv.reading.value == 256 * MIB and comp.reading.value == 300 * MIB
    assert other.reading.kind is Kind.INFERRED
    assert other.reading.value == vram - (1000 + 256 + 300) * MIB
    # the measured total is the driver's number alone; the view adds nothing to it
    assert snap.attributed == vram
    doc = json.loads(json.dumps(report.to_json_dict(snap, system)))
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert report.null_rule_violations(doc) == []
    bd = next(p for p in doc["processes"] if p["pid"] == server.pid)["breakdown"]
    assert bd["parts"]["other"]["reading"]["kind"] == "inferred"
    assert doc["attributed_bytes"] == vram


def test_breakdown_of_estimates_only_keeps_null_rules_and_never_enters_totals(tmp_path):
    model = tmp_path / "m.gguf"
    write_model(model, "llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=256)
    path = str(model.resolve())
    claim = assess([Evidence(Source.MAPPED, path=path), Evidence(Source.CMDLINE, path=path)])[0]
    header = gguf.read_header(model)
    view = llm.build_view(claim, header=header, runtime="llama.cpp", argv=("-c", "64"))
    row = ProcGpu(
        42,
        1.0,
        "llama-server",
        BUS,
        ("compute",),
        Reading.measured(3 * MIB, "nvml:mock"),
        breakdown=view,
    )
    snap = Snapshot(
        taken=1.0,
        backend="nvml",
        adapters=(Adapter(0, "nvidia", None, None, BUS, "nvml"),),
        processes=(row,),
    )
    doc = json.loads(json.dumps(report.to_json_dict(snap, None)))
    assert schema.errors(doc) == []  # the packaged JSON Schema
    assert report.null_rule_violations(doc) == []
    bd = doc["processes"][0]["breakdown"]
    assert bd["parts"]["weights"]["reading"]["kind"] == "estimated"
    assert bd["parts"]["weights"]["reading"]["value"] == header.weights_bytes
    assert bd["parts"]["compute"]["reading"]["value"] is None  # only logs know compute
    assert bd["estimated_total"]["kind"] == "estimated"
    assert bd["reported_total"]["value"] is None and bd["reported_total"]["reason"]
    assert doc["attributed_bytes"] == 3 * MIB  # estimates never summed into it
    text = text_report.render_text(snap, None)
    assert "MODELS" in text and f"≈{report.fmt_bytes(header.weights_bytes)}" in text


def test_background_looks_never_block_a_refresh(server):
    """The resolver's costly look is held on an event (a seam around the real `gather`):
    `resolve` answers at once with the cheap, pending ref, and the full one later."""
    resolver = ModelResolver(background=True, index=StoreIndex(StoreRoots()))
    gate = threading.Event()
    real = resolver._gather

    def held(info):
        gate.wait(10)
        return real(info)

    resolver._gather = held  # type: ignore[method-assign]
    try:
        info = scan_process(server.pid)
        t0 = time.perf_counter()
        first = resolver.resolve(info)
        assert time.perf_counter() - t0 < 0.5
        assert first.ref is not None and first.ref.pending and first.view is None
        assert first.ref.evidence == "mapped" and first.ref.confirmed  # mapped + cmdline
        again = resolver.resolve(info)  # a second refresh while the look is held
        assert again.ref is not None and again.ref.pending
        gate.set()
        assert resolver.wait_idle(15)
        done = resolver.resolve(info)
        assert done.ref is not None and not done.ref.pending
        assert done.ref.evidence == "api" and done.view is not None
    finally:
        gate.set()
        resolver.close()


def test_collector_models_only_with_a_scanner_that_gives_procinfo():
    """Catches the collector deciding by the scanner's class instead of what the scanner
    declares (`ProcScanner.gives_procinfo`): a scanner of another class that declares it
    gets model resolution too."""
    from gputaskman.sampling.collector import NullScanner

    class Declaring(NullScanner):
        gives_procinfo = True

    seam = Collector(scanner=NullScanner(), source=MockNvml(1, 1))
    assert seam.models is None
    real = Collector(scanner=ProcinfoScanner(), source=MockNvml(1, 1))
    other = Collector(scanner=Declaring(), source=MockNvml(1, 1), scan_budget=None)
    try:
        assert isinstance(real.models, ModelResolver) and real.models.background
        assert isinstance(other.models, ModelResolver) and not other.models.background
    finally:
        real.close()
        seam.close()
        other.close()
