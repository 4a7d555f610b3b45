"""Write the record files in this folder with the gputaskman of the day, through `record`'s
own `Recorder` (the code behind ``gputaskman record``):

* ``demo.jsonl``: `gputaskman.fixtures.demo`'s synthetic snapshot over four samples (not
  measured), changed from sample to sample so diff and summary have work: GPU memory and a
  process's VRAM grow (once by less than 1 MiB), a process goes away and another appears.
  It carries what the demo alone lacks: a weights / KV / compute breakdown built from a real
  GGUF header and a llama.cpp log, an app's selected model, every optional process field
  set, and a duvm pool in the host sample.
* ``drm.jsonl``: three samples of the DRM fixture tree (`gputaskman.fixtures.drm_fixtures`,
  an amdgpu and an Intel card with fdinfo clients) through the ``--sysroot`` collector.

They are kept as written: recordings of a released version must still replay, diff and
summarise (tests/test_recordings.py). ``expected/`` holds what summary and diff printed
for them when they were written. Rewrite both only on purpose:
``uv run python packages/gputaskman/tests/recordings/write_recordings.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gputaskman.base.readings import Kind, ModelRef, ProcDetail, ProcGpu, Reading, Reason
from gputaskman.fixtures.demo import GIB, MIB, demo_snapshot
from gputaskman.fixtures.drm_fixtures import write_demo_tree
from gputaskman.intel import gguf, llm
from gputaskman.intel.apps import AppModel
from gputaskman.intel.evidence import Evidence, Source, assess
from gputaskman.offline.record import Recorder, open_record
from gputaskman.sampling import duvmpool, host
from gputaskman.sampling.collector import sysroot_collector

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
MODEL = "/models/qwen2.5-0.5b-q8_0.gguf"
SOCKET = "/run/duvm/daemon.ctl"


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def gguf_header(tmp: Path) -> gguf.GGUFHeader:
    model = tmp / "model.gguf"
    _load(TESTS / "gguf_files.py", "gguf_files").write_model(
        model, "qwen2", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, ctx=1024
    )
    return gguf.read_header(model)


def _breakdown(header: gguf.GGUFHeader, measured_bytes: int) -> llm.LlmView:
    claim = assess([Evidence(Source.MAPPED, path=MODEL), Evidence(Source.CMDLINE, path=MODEL)])[0]
    log = (
        "load_tensors:        CUDA0 model buffer size =  7800.00 MiB\n"
        "llama_kv_cache:      CUDA0 KV buffer size =  1024.00 MiB\n"
        "sched_reserve:       CUDA0 compute buffer size =   300.70 MiB\n"
    )
    view = llm.build_view(
        claim,
        header=header,
        buffers=llm.parse_buffer_log(log, "/var/log/llama-server.log"),
        runtime="llama.cpp",
        argv=["llama-server", "-m", MODEL, "-c", "512"],
        device="CUDA0",
        measured_bytes=measured_bytes,
    )
    assert view is not None
    return view


def _pool(i: int) -> duvmpool.PoolInfo:
    src = f"duvm daemon:{SOCKET}"
    peer = duvmpool.PeerPages(
        "10.0.0.2:7000",
        True,
        Reading.runtime(272 + i, src),
        Reading.runtime(512, src),
        Reading.runtime(2, src),
    )
    daemon = duvmpool.DaemonPool(
        SOCKET,
        1234,
        Reading.runtime(256 * MIB, src),
        Reading.runtime(1, src),
        Reading.runtime(272 + i, src),
        Reading.runtime(0, src),
        Reading.runtime(0, src),
        "ok",
        (),
        (peer,),
    )
    ms_src = "duvm memserver:/run/duvm/memserver.ctl"
    lending = duvmpool.Lending(
        "/run/duvm/memserver.ctl",
        Reading.runtime(1 * GIB, ms_src),
        Reading.runtime((100 + i) * MIB, ms_src),
        Reading.runtime(128 * MIB, ms_src),
        (
            duvmpool.Borrower(
                "node-b", Reading.runtime((100 + i) * MIB, ms_src), Reading.runtime(0, ms_src), 2
            ),
        ),
        3,
    )
    return duvmpool.PoolInfo(
        daemons=(daemon,), lending=(lending,), errors={"/run/duvm/gone.ctl": "refused"}
    )


class DemoSampler:
    """Sample i of the changing demo (see the module docstring), with a host sample in
    host.py's own shape."""

    def __init__(self, header: gguf.GGUFHeader) -> None:
        self.header = header
        self.i = 0
        self.demo_system = _load(
            TESTS.parents[2] / "tools" / "capture_screenshots.py", "capture_screenshots"
        ).demo_system

    def sample_with_system(self) -> tuple[Any, Any]:
        i, self.i = self.i, self.i + 1
        base = demo_snapshot()
        llama, python, xorg, whisper, cli = base.processes
        grow = min(i, 2) * 256 * MIB + (512 * 1024 if i == 3 else 0)  # the last step: < 1 MiB
        vram = int(llama.dedicated.value) + grow
        llama = dataclasses.replace(
            llama,
            dedicated=Reading.measured(vram, "nvml:nvmlDeviceGetComputeRunningProcesses"),
            detail=dataclasses.replace(
                llama.detail,
                cmdline=("llama-server", "-m", MODEL, "-c", "512", "--api-key", "***"),
                exe="/usr/local/bin/llama-server",
                model_evidence=(("mapped", MODEL), ("cmdline", MODEL)),
                model_files=(MODEL,),
            ),
            model=ModelRef(
                "qwen2.5-0.5b-q8_0",
                "mapped",
                True,
                MODEL,
                None,
                "confirmed",
                ("mapped", "cmdline"),
                False,
                "llama.cpp",
                "127.0.0.1:8080",
                ("GET /v1/models: timed out",),
                "tensor data past the end of the file",
            ),
            breakdown=_breakdown(self.header, vram),
            paged=Reading.measured(64 * MIB, "demo:paged"),
            footprint=Reading.measured(10 * GIB, "demo:footprint"),
        )
        whisper = dataclasses.replace(
            whisper,
            app_model=AppModel(
                "Handy",
                "whisper-small",
                "/home/user/.local/share/com.pais.handy/settings_store.json",
                "loaded",
                "whisper-small",
                "2026-12-01 10:00:00",
                "/home/user/.local/share/com.pais.handy/logs/handy.log",
                ("log: last event 'loaded'",),
            ),
            detail=dataclasses.replace(
                whisper.detail,
                reason=Reason.DENIED,
                reason_detail="/proc/9001/maps: permission denied",
            ),
        )
        procs: list[ProcGpu] = [llama, python, xorg, whisper, cli]
        if i == 3:
            procs.remove(python)  # went away
        if i >= 2:
            procs.append(
                ProcGpu(
                    6060,
                    base.taken,
                    "ollama",
                    base.adapters[1].pci_bus_id,
                    ("compute",),
                    Reading.measured(700 * MIB, "nvml:nvmlDeviceGetComputeRunningProcesses"),
                    inferred=Reading.inferred(650 * MIB, "demo:rule"),
                    detail=ProcDetail(runtimes=("CUDA runtime",), category="LLM inference?"),
                    unique=True,
                )
            )
        bus0 = base.adapters[0].pci_bus_id
        metrics = dict(base.metrics)
        used = metrics[bus0].memory_used_bytes
        metrics[bus0] = dataclasses.replace(
            metrics[bus0],
            memory_used_bytes=Reading(used.value + grow, Kind.MEASURED, used.source),
        )
        snap = dataclasses.replace(
            base, taken=base.taken + 2 * i, metrics=metrics, processes=tuple(procs)
        )
        system = dataclasses.replace(
            self.demo_system(snap),
            taken=snap.taken,
            duvm=_pool(i) if i >= 1 else None,
            processes_reason=None,
        )
        if i == 0:  # a first sample: no CPU rate yet
            system = dataclasses.replace(
                system,
                cpu=dataclasses.replace(
                    system.cpu,
                    percent=Reading.missing(Reason.UNAVAILABLE, "/proc/stat", host.FIRST_SAMPLE),
                ),
                processes=MappingProxyType({}),
            )
        return snap, system

    def close(self) -> None:
        pass


class DrmSampler:
    """The ``--sysroot`` collector over the DRM fixture tree, advanced one step per sample
    (engine counters move, so rates are known from the second sample on)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.step = 0
        write_demo_tree(root)
        self.collector = sysroot_collector(str(root))

    def sample_with_system(self) -> tuple[Any, Any]:
        write_demo_tree(self.root, step=self.step)
        self.step += 1
        return self.collector.sample_with_system()

    def close(self) -> None:
        self.collector.close()


def record(path: Path, sampler: Any, count: int, interval: float) -> None:
    if path.exists():
        path.unlink()
    fd = open_record(path)
    try:
        result = Recorder(fd, sampler, interval=interval, count=count).run()
    finally:
        sampler.close()
        os.close(fd)
    assert result.samples == count and not result.failures, result


def expected_outputs(rec: Path) -> None:
    """What summary and diff (first against last sample, and the last two) print for `rec`,
    in ``expected/``; the file is named relative to this folder, so the text is the same
    wherever the repository is."""
    out = HERE / "expected"
    out.mkdir(exist_ok=True)
    name = rec.name
    runs = {
        "summary.txt": ["summary", name],
        "summary.json": ["summary", "--json", name],
        "diff.txt": ["diff", f"{name}@1", f"{name}@-1"],
        "diff.json": ["diff", "--json", f"{name}@1", f"{name}@-1"],
        "diff-last.txt": ["diff", f"{name}@-2", f"{name}@-1"],
        "diff-last.json": ["diff", "--json", f"{name}@-2", f"{name}@-1"],
    }
    for suffix, args in runs.items():
        res = subprocess.run(
            [sys.executable, "-m", "gputaskman.cli", *args],
            capture_output=True,
            text=True,
            cwd=HERE,
            timeout=120,
            check=True,
        )
        (out / f"{rec.stem}.{suffix}").write_text(res.stdout)


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        record(HERE / "demo.jsonl", DemoSampler(gguf_header(Path(tmp))), count=4, interval=0.01)
        record(HERE / "drm.jsonl", DrmSampler(Path(tmp) / "root"), count=3, interval=0.5)
    for rec in (HERE / "demo.jsonl", HERE / "drm.jsonl"):
        expected_outputs(rec)
    print(json.dumps(sorted(p.name for p in HERE.rglob("*") if p.is_file())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
