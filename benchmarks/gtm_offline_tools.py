"""Cost of gputaskman's offline tools on an hour-long recording (mocked GPU data).

Builds a synthetic snapshot (2 GPUs, 30 GPU processes with command lines; GPU numbers are
made up, the shape is exactly `report.to_json_dict`'s), then measures:

* record: encoding one line, appending it with `record.write_line`, and what an fsync per
  line would add (the recorder does not fsync per line; this shows why);
* replay: `RecordSource.open` over 3,600 lines (the scan that validates every line) and
  its peak Python memory, then loading a frame;
* summary: `summary.summarize` over the same file.

Run: ``uv run python benchmarks/gtm_offline_tools.py [LINES]``. Numbers depend on the
machine and on what else runs; report them with that caveat.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from gputaskman.base.readings import (
    Adapter,
    DeviceMetrics,
    ProcDetail,
    ProcGpu,
    Reading,
    Snapshot,
)
from gputaskman.offline import record, summary
from gputaskman.offline.playback import RecordSource
from gputaskman.render import report

GIB = 1024**3
BUSES = ("00000000:01:00.0", "00000000:41:00.0")


def snapshot(taken: float) -> Snapshot:
    m = Reading.measured
    adapters = tuple(
        Adapter(i, "nvidia", "NVIDIA Mock GPU", f"GPU-{i}", b, "nvml") for i, b in enumerate(BUSES)
    )
    metrics = {b: DeviceMetrics(*(m(1000 + i, "nvml:mock") for i in range(13))) for b in BUSES}
    procs = tuple(
        ProcGpu(
            1000 + i,
            taken - 500 - i,
            f"worker-{i}",
            BUSES[i % 2],
            ("compute",),
            m((i + 1) * 64 * 1024**2, "nvml:mock"),
            engines={"gpu_percent": m(i % 100, "nvml:mock")},
            detail=ProcDetail(
                cmdline=("python", "-m", "serve", "--model", f"/models/m{i}.gguf", "--port", "80"),
                runtimes=("CUDA runtime", "cuBLAS"),
                scanned=True,
            ),
        )
        for i in range(30)
    )
    return Snapshot(taken, "nvml", adapters, metrics, procs, driver_version="550.00")


def main() -> None:
    lines = int(sys.argv[1]) if len(sys.argv) > 1 else 3600
    base = snapshot(1796000000.0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        enc, wr = [], []
        try:
            for i in range(lines):
                snap = dataclasses.replace(base, taken=base.taken + i)
                t0 = time.perf_counter()
                data = record.encode_line(report.to_json_dict(snap, None))
                t1 = time.perf_counter()
                record.write_line(fd, data)
                wr.append(time.perf_counter() - t1)
                enc.append(t1 - t0)
            fs = []
            for _ in range(50):
                record.write_line(fd, data)
                t0 = time.perf_counter()
                os.fsync(fd)
                fs.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
        size = path.stat().st_size
        print(f"record: {lines + 50} lines, {size / 1e6:.1f} MB, {len(data)} bytes per line")
        print(f"  to_json_dict + encode  median {statistics.median(enc) * 1e3:.2f} ms")
        print(f"  write_line             median {statistics.median(wr) * 1e6:.0f} us")
        print(f"  fsync (not done per line) median {statistics.median(fs) * 1e3:.2f} ms")

        t0 = time.perf_counter()
        src = RecordSource.open(path)
        scan = time.perf_counter() - t0
        tracemalloc.start()  # a second scan for memory: tracing slows it several times
        RecordSource.open(path)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        t0 = time.perf_counter()
        src.load(len(src.frames) // 2)
        load = time.perf_counter() - t0
        print(
            f"replay: open {scan:.2f} s for {len(src.frames)} frames, peak {peak / 1e6:.1f} MB;"
            f" one frame {load * 1e3:.1f} ms"
        )

        t0 = time.perf_counter()
        s = summary.summarize(path)
        print(f"summary: {time.perf_counter() - t0:.2f} s, {len(s.runs)} run(s)")


if __name__ == "__main__":
    main()
