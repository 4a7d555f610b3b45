"""Micro-benchmark of the page protocol: memserver round trips and batch throughput.

Starts `duvm memserver` as its own process on loopback (pinned with taskset when --pin is
given), then drives it from this process with `MemClient` (and `RemoteStore`, the layer the NBD
daemon calls) on uvloop:

- QD1: one request at a time, latency percentiles (4 KiB STORE / LOAD).
- QD16: 16 coroutines each with one request in flight, requests/s.
- batches: 64-page (256 KiB) and 256-page (1 MiB) STORE / LOAD, pages/s and MiB/s.

For every case it records the CPU time both processes spent per request (from
/proc/PID/stat), since on a shared 2-core VM wall-clock numbers are noisy. Each case runs
--repeat times and the median is reported.

    uv run python benchmarks/bench_memserver.py [--seconds 2] [--repeat 3] [--pin]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time

from duvm.store.memclient import MemClient
from duvm.store.remote_store import RemoteStore

PS = 4096
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def timed(
    label: str, op, qd: int, seconds: float, server_pid: int, pages_per_op: int = 1
) -> dict:
    """Run op(worker, i) from `qd` workers for about `seconds`; return rates and CPU costs."""
    deadline = time.perf_counter() + seconds
    lat: list[float] = []
    count = [0]

    async def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await op(w, i)
            if qd == 1:
                lat.append(time.perf_counter() - t)
            i += 1
            count[0] += 1

    c0, s0, t0 = cpu_seconds(os.getpid()), cpu_seconds(server_pid), time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(qd)))
    dt = time.perf_counter() - t0
    n = count[0]
    res = {
        "case": label,
        "ops_s": n / dt,
        "mib_s": n * pages_per_op * PS / dt / (1 << 20),
        "client_us_op": (cpu_seconds(os.getpid()) - c0) / n * 1e6,
        "server_us_op": (cpu_seconds(server_pid) - s0) / n * 1e6,
    }
    if lat:
        lat.sort()
        res["p50_us"] = lat[len(lat) // 2] * 1e6
        res["p99_us"] = lat[int(len(lat) * 0.99)] * 1e6
    return res


async def run_cases(addr: tuple[str, int], pid: int, seconds: float) -> list[dict]:
    c = MemClient(*addr, "bench/1")
    await c.connect()
    await c.reserve(8192)
    page = os.urandom(PS)
    await c.store(range(4096), os.urandom(4096 * PS))
    outs = [memoryview(bytearray(256 * PS)) for _ in range(16)]
    big = os.urandom(256 * PS)
    results = []

    async def store1(w: int, i: int) -> None:
        await c.store([(w * 256 + i) % 4096], page)

    async def load1(w: int, i: int) -> None:
        await c.load([(w * 256 + i * 7) % 4096], outs[w][:PS])

    for qd in (1, 16):
        results.append(await timed(f"STORE 4K QD{qd}", store1, qd, seconds, pid))
        results.append(await timed(f"LOAD 4K QD{qd}", load1, qd, seconds, pid))
    for n in (64, 256):
        keys = [list(range(j * n, (j + 1) * n)) for j in range(4096 // n)]

        async def storeb(w: int, i: int, n: int = n, keys: list = keys) -> None:
            await c.store(keys[i % len(keys)], big[: n * PS])

        async def loadb(w: int, i: int, n: int = n, keys: list = keys) -> None:
            await c.load(keys[i % len(keys)], outs[w][: n * PS])

        for qd in (1, 4):
            results.append(await timed(f"STORE {n}p QD{qd}", storeb, qd, seconds, pid, n))
            results.append(await timed(f"LOAD {n}p QD{qd}", loadb, qd, seconds, pid, n))
    await c.release()
    await c.close()

    store = await RemoteStore.open([addr], 16 << 20, "bench/store/1")
    await store.write(0, memoryview(os.urandom(16 << 20)))

    async def rs_read(w: int, i: int) -> None:
        await store.read(((w * 97 + i * 31) % 4096) * PS, outs[w][:PS])

    async def rs_write(w: int, i: int) -> None:
        await store.write(((w * 97 + i * 31) % 4096) * PS, memoryview(page))

    async def rs_read256(w: int, i: int) -> None:
        await store.read((i % 64) * 64 * PS, outs[w][: 64 * PS])

    async def rs_write256(w: int, i: int) -> None:
        await store.write((i % 64) * 64 * PS, memoryview(big)[: 64 * PS])

    for qd in (1, 16):
        results.append(await timed(f"RemoteStore read 4K QD{qd}", rs_read, qd, seconds, pid))
        results.append(await timed(f"RemoteStore write 4K QD{qd}", rs_write, qd, seconds, pid))
    results.append(await timed("RemoteStore read 256K QD1", rs_read256, 1, seconds, pid, 64))
    results.append(await timed("RemoteStore write 256K QD1", rs_write256, 1, seconds, pid, 64))
    await store.close()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per case (default 2)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case, median reported")
    ap.add_argument("--pin", action="store_true", help="server on CPU 1, client on CPU 0")
    args = ap.parse_args()
    cmd = [
        sys.executable,
        "-m",
        "duvm.cli",
        "memserver",
        "--listen",
        "127.0.0.1:0",
        "--capacity",
        "128M",
    ]
    if args.pin:
        cmd = ["taskset", "-c", "1", *cmd]
        os.sched_setaffinity(0, {0})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.search(r"listening on ([\d.]+):(\d+)", line)
        if not m:
            print(f"memserver did not start: {line!r}", file=sys.stderr)
            return 1
        addr = (m.group(1), int(m.group(2)))
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:
            runner = asyncio.run
        runs = [runner(run_cases(addr, proc.pid, args.seconds)) for _ in range(args.repeat)]
    finally:
        proc.terminate()
        proc.wait(10)
    cpus = os.cpu_count()
    print(
        f"# bench_memserver: {cpus} CPUs, load {os.getloadavg()[0]:.2f}, "
        f"pinned={'server cpu1, client cpu0' if args.pin else 'no'}, "
        f"median of {args.repeat} x {args.seconds:g}s"
    )
    print(
        f"{'case':30} {'ops/s':>9} {'MiB/s':>8} {'p50 us':>7} {'p99 us':>7} "
        f"{'cli us/op':>9} {'srv us/op':>9}"
    )
    for i, first in enumerate(runs[0]):
        col = {k: statistics.median(r[i][k] for r in runs) for k in first if k != "case"}
        p50 = f"{col['p50_us']:7.0f}" if "p50_us" in col else f"{'':7}"
        p99 = f"{col['p99_us']:7.0f}" if "p99_us" in col else f"{'':7}"
        print(
            f"{first['case']:30} {col['ops_s']:9.0f} {col['mib_s']:8.1f} {p50} {p99} "
            f"{col['client_us_op']:9.1f} {col['server_us_op']:9.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
