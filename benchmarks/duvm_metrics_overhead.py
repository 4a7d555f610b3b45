#!/usr/bin/env python3
"""What `--metrics` costs duvm's hot path.

Two measurements in one run:

1. **Per observation** (timeit, in this process): the two `perf_counter_ns()` calls and
   `LatencyByKind.observe_ns` that the memserver (per frame) and the daemon (per NBD
   request) add when `--metrics` is on, next to `prometheus_client.Histogram.labels(op)
   .observe()` (the library's own histogram, which the hot path does not use) and an empty
   loop body.
2. **End to end**: fio's `nbd` engine, 4 KiB random writes then reads at queue depth 1 and 16,
   against a duvm daemon + one memserver on loopback, with and without `--metrics` on both,
   interleaved `--reps` times; median IOPS and mean latency per configuration.

Usage: uv run python benchmarks/duvm_metrics_overhead.py [--reps 3] [--runtime 4] [--json F]

On a shared 2-core VM the end-to-end numbers are noisy (other work runs beside them); the
per-observation numbers are the stable part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

from duvm.base import metrics
from duvm.memserver.metrics import MEMSERVER_KINDS
from prometheus_client import CollectorRegistry, Histogram


def micro(n: int = 1_000_000) -> dict[str, float]:
    """Nanoseconds per call of each variant (best of 5 runs of n)."""
    lat = metrics.LatencyByKind(MEMSERVER_KINDS)
    kind = next(iter(MEMSERVER_KINDS))
    hist = Histogram(
        "x_seconds", "x", ["op"], registry=CollectorRegistry(), buckets=metrics.LATENCY_BOUNDS_S
    )
    env = {"lat": lat, "kind": kind, "hist": hist, "d": {}, "k": object()}
    setup = "from time import perf_counter_ns, perf_counter"
    cases = {
        "empty loop body": "pass",
        "2x perf_counter_ns alone": "t0 = perf_counter_ns(); x = perf_counter_ns() - t0",
        "memserver hook: 2x perf_counter_ns + LatencyByKind.observe_ns": (
            "t0 = perf_counter_ns(); lat.observe_ns(kind, perf_counter_ns() - t0)"
        ),
        "daemon hook: + request start time kept in a dict (set and pop)": (
            "d[k] = perf_counter_ns(); lat.observe_ns(kind, perf_counter_ns() - d.pop(k))"
        ),
        "prometheus_client Histogram.labels(op).observe (not used)": (
            "t0 = perf_counter(); hist.labels('store').observe(perf_counter() - t0)"
        ),
        "the check when --metrics is off (lat is None)": "if None is not None: pass",
    }
    out = {}
    for name, stmt in cases.items():
        best = min(timeit.repeat(stmt, setup, number=n, repeat=5, globals=env))
        out[name] = best / n * 1e9
    return out


def _start(args: list[str], ready: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "duvm.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert p.stdout is not None
    seen = ""
    deadline = time.monotonic() + 30
    while ready not in seen:
        line = p.stdout.readline()
        if not line or time.monotonic() > deadline:
            p.kill()
            raise SystemExit(f"duvm {args[0]} did not start: {seen}{line}")
        seen += line
    return p, seen


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def fio(sock: str, rw: str, qd: int, runtime: int, size: str) -> dict[str, float]:
    cmd = [
        "fio",
        "--name=m",
        "--ioengine=nbd",
        f"--uri=nbd+unix:///?socket={sock}",
        f"--rw={rw}",
        "--bs=4k",
        f"--iodepth={qd}",
        f"--size={size}",
        "--time_based",
        f"--runtime={runtime}",
        "--output-format=json",
        "--random_generator=lfsr",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=runtime + 120)
    if r.returncode != 0:
        raise SystemExit(f"fio failed: {r.stderr[-1000:]}")
    job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]
    side = job["read"] if rw.endswith("read") else job["write"]
    return {"iops": side["iops"], "lat_us": side["lat_ns"]["mean"] / 1000}


def end_to_end(reps: int, runtime: int, size: str) -> dict[str, dict[str, float]]:
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="duvm-mbench-") as tmp:
        for rep in range(reps):
            for on in (False, True) if rep % 2 == 0 else (True, False):
                extra = ["--metrics", "127.0.0.1:0"] if on else []
                ms, out = _start(
                    ["memserver", "--listen", "127.0.0.1:0", "--capacity", "1G", *extra],
                    "listening on",
                )
                port = re.search(r"listening on 127\.0\.0\.1:(\d+)", out).group(1)  # type: ignore[union-attr]
                sock = os.path.join(tmp, f"nbd{rep}{int(on)}.sock")
                d, _ = _start(
                    [
                        "daemon",
                        "--peers",
                        f"127.0.0.1:{port}",
                        "--size",
                        size,
                        "--socket",
                        sock,
                        "--replicas",
                        "1",
                        *extra,
                    ],
                    "serving export",
                )
                try:
                    for rw in ("randwrite", "randread"):
                        for qd in (1, 16):
                            key = f"{rw} qd{qd} metrics={'on' if on else 'off'}"
                            results.setdefault(key, []).append(fio(sock, rw, qd, runtime, size))
                finally:
                    _stop(d)
                    _stop(ms)
    return {
        k: {
            "iops": statistics.median(r["iops"] for r in v),
            "lat_us": statistics.median(r["lat_us"] for r in v),
            "runs": len(v),
        }
        for k, v in results.items()
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=4, help="seconds per fio run")
    ap.add_argument("--size", default="256M", help="export size (fio works over all of it)")
    ap.add_argument("--no-e2e", action="store_true", help="only the per-observation numbers")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    out: dict = {"loadavg": os.getloadavg(), "cpus": os.cpu_count(), "micro_ns": micro()}
    for k, v in out["micro_ns"].items():
        print(f"{v:8.1f} ns  {k}")
    if not args.no_e2e:
        if shutil.which("fio") is None:
            print("fio not installed: end-to-end part skipped", file=sys.stderr)
        else:
            out["e2e"] = end_to_end(args.reps, args.runtime, args.size)
            for k, v in sorted(out["e2e"].items()):
                print(f"{k:32s} {v['iops']:10.0f} IOPS  {v['lat_us']:8.1f} us mean")
    out["loadavg_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
