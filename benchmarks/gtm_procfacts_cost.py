"""What each row's swapped / locked / pinned memory and owner cost per refresh
(`gputaskman.sampling.procfacts`), and the totals by owner.

Usage::

    uv run python benchmarks/gtm_procfacts_cost.py [--rows 50] [--repeat 200]

Starts `--rows` idle ``sleep`` processes (real processes, in this shell's cgroup), makes one
snapshot row for each and times ``RowFacts.annotate`` over all of them (one ``open`` of
/proc/PID and three small reads per row: stat, status, cgroup), ``--repeat`` times, printing
the median per row in microseconds; then the parts alone (``parse_status``, ``parse_cgroup``
of a kubelet systemd-driver path, the pod log directory check), and the totals by owner and
their JSON for 1,000 rows (the demo's rows, each given a pod). Medians, ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gputaskman.base import procfs
from gputaskman.base.cgroupname import parse_cgroup
from gputaskman.base.owners import owner_totals
from gputaskman.base.readings import Owner, ProcGpu, Reading
from gputaskman.fixtures.demo import demo_snapshot
from gputaskman.render.report_owners import totals_json
from gputaskman.sampling import procfacts

BUS = "00000000:01:00.0"
KUBE = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
    "0d7bd4c5_1e8f_4c3d_9d5e_5f0c8e3a4b21.slice/cri-containerd-" + "ab" * 32 + ".scope\n"
)


def median_us(fn: Callable[[], object], repeat: int, per: int = 1) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) / per * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(args.rows)]
    try:
        btime = procfs.boot_time() or 0.0
        rows = [
            ProcGpu(
                p.pid,
                procfs.create_time(procfs.read_stat(p.pid).start_ticks, btime),
                "sleep",
                BUS,
                ("compute",),
                Reading.measured(1 << 30, "bench"),
            )
            for p in procs
        ]
        facts = procfacts.RowFacts()
        facts.annotate(rows, None, None)  # the user name cached, as after a first refresh
        per_row = median_us(lambda: facts.annotate(rows, None, None), args.repeat, len(rows))
        print(f"RowFacts.annotate: {per_row:.1f} µs per row ({len(rows)} rows)")
    finally:
        for p in procs:
            p.kill()
            p.wait()
    status = Path("/proc/self/status").read_bytes()
    print(f"parse_status: {median_us(lambda: procfacts.parse_status(status), 2000):.1f} µs")
    print(f"parse_cgroup (kubelet path): {median_us(lambda: parse_cgroup(KUBE), 2000):.1f} µs")
    with tempfile.TemporaryDirectory() as d:
        pods = procfacts.RowFacts(pods_dir=d)
        pods.pod_names()
        print(f"pod log directory, unchanged: {median_us(pods.pod_names, 2000):.1f} µs")
    snap = demo_snapshot()
    base = [p for p in snap.processes if p.adapter is not None]
    many = [
        dataclasses.replace(
            base[i % len(base)],
            pid=10_000 + i,
            owner=Owner("/kubepods/x", user="u", pod_uid=f"pod-{i % 20}"),
        )
        for i in range(1000)
    ]
    big = dataclasses.replace(snap, processes=tuple(many))
    print(f"owner_totals, 1,000 rows: {median_us(lambda: owner_totals(big), 50) / 1000:.2f} ms")
    print(f"totals_json, 1,000 rows: {median_us(lambda: totals_json(big), 50) / 1000:.2f} ms")


if __name__ == "__main__":
    main()
