# ruff: noqa: E501  (npu-smi table rows must keep their real width)
"""Cost of the non-Linux backends' pure parts, on this (Linux) machine.

Usage::

    uv run python benchmarks/gtm_platform_parsers.py            # 1000 GPU processes
    uv run python benchmarks/gtm_platform_parsers.py -n 200 --repeat 50

What it measures (median wall time of one call, over --repeat runs):

1. ``win.pdh.aggregate`` over one refresh of synthetic PDH reads: N processes on one
   adapter, each with Local/Non Local Usage and 3 engine instances (the shapes Windows
   publishes; made-up values). This is the CPU cost per refresh on Windows and WSL,
   *excluding* PDH's own collection time, which only Windows can measure.
2. ``wslhost.StreamParser.feed`` of the same sample in the host-stream line format
   (bytes per second), i.e. what WSL spends turning powershell.exe's output into frames.
3. ``ascend.parse_npu_smi`` + ``to_sample`` of a 16-chip ``npu-smi info`` table with N
   process rows, excluding the ``npu-smi`` run itself (not available here).
4. ``wslhost.ContextTracker.update`` with 8 holders.

Nothing here touches a GPU, Windows, WSL, macOS or Ascend hardware. The machine is shared
(2 vCPUs, other work running), so medians are printed and numbers are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from gputaskman.backends.ascend import parse_npu_smi, to_sample
from gputaskman.backends.win import pdh
from gputaskman.backends.wslhost import ContextTracker, StreamParser

MIB = 1024**2


def pdh_reads(n: int) -> dict[str, pdh.CounterRead]:
    luid = "luid_0x00000000_0x0000D1A2"
    local, non_local, engine = {}, {}, {}
    for pid in range(4, 4 + n):
        inst = f"pid_{pid}_{luid}_phys_0"
        local[inst] = float(pid * MIB)
        non_local[inst] = float(MIB)
        for eng, typ in ((0, "3D"), (1, "Copy"), (5, "Compute_0")):
            engine[f"{inst}_eng_{eng}_engtype_{typ}"] = 1.5
    return {
        pdh.LOCAL: pdh.CounterRead.ok(local),
        pdh.NON_LOCAL: pdh.CounterRead.ok(non_local),
        pdh.ENGINE: pdh.CounterRead.ok(engine),
        pdh.ADAPTER_DEDICATED: pdh.CounterRead.ok({f"{luid}_phys_0": 8e9}),
        pdh.ADAPTER_SHARED: pdh.CounterRead.ok({f"{luid}_phys_0": 1e8}),
    }


def stream_bytes(reads: dict[str, pdh.CounterRead]) -> bytes:
    codes = {
        v: k
        for k, v in {
            "L": pdh.LOCAL,
            "N": pdh.NON_LOCAL,
            "E": pdh.ENGINE,
            "D": pdh.ADAPTER_DEDICATED,
            "S": pdh.ADAPTER_SHARED,
        }.items()
    }
    lines = ["gtm1\tT\t1\t1796000000000"]
    for path, r in reads.items():
        for inst, v in (r.values or {}).items():
            lines.append(f"gtm1\tC\t{codes[path]}\t{inst}\t{v!r}")
    lines.append("gtm1\tZ\t1")
    return ("\n".join(lines) + "\n").encode()


def npu_smi_text(n: int) -> str:
    sep = "+===========================+===============+====================================================+"
    rows = [
        "| npu-smi 23.0.2.1                 Version: 23.0.2.1                                             |",
        "| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|",
        "| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |",
        sep,
    ]
    for npu in range(16):
        rows.append(
            f"| {npu:<5} 910B2C              | OK            | 90.0        50                0    / 0             |"
        )
        rows.append(
            f"| 0                         | 0000:{npu + 1:02X}:00.0  | 10          0    / 0          3000 / 65536         |"
        )
        rows.append(sep)
    rows.append(
        "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |"
    )
    rows.append(sep)
    for i in range(n):
        rows.append(
            f"| {i % 16:<7} 0                 | {1000 + i:<13} | python                   | 100                     |"
        )
    return "\n".join(rows) + "\n"


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=1000, help="GPU processes per sample")
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    reads = pdh_reads(a.n)
    t = median_s(lambda: pdh.aggregate(reads), a.repeat)
    print(f"pdh.aggregate, {a.n} processes x (2 memory + 3 engine instances): {t * 1e3:.2f} ms")
    data = stream_bytes(reads)
    t = median_s(lambda: StreamParser().feed(data), a.repeat)
    print(
        f"StreamParser.feed, {len(data) / 1024:.0f} KiB sample: {t * 1e3:.2f} ms "
        f"({len(data) / t / 2**20:.0f} MiB/s)"
    )
    text = npu_smi_text(a.n)
    t = median_s(lambda: to_sample(parse_npu_smi(text)), a.repeat)
    print(f"parse_npu_smi + to_sample, 16 chips, {a.n} process rows: {t * 1e3:.2f} ms")
    tracker = ContextTracker()
    holders = [(p, float(p)) for p in range(8)]
    t = median_s(lambda: tracker.update(4 * 1024 * MIB, holders), a.repeat)
    print(f"ContextTracker.update, 8 holders: {t * 1e6:.1f} µs")


if __name__ == "__main__":
    main()
