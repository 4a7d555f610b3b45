"""How a deployed daemon scales with its workers (`duvm daemon --workers N`, DECISIONS.md D49).

For each N of `--workers` (default 1,2), side by side in one run: two memservers, the daemon in
the deployed configuration (two copies, pages encrypted, peers authenticated, state on
/dev/shm) with N workers, and fio's NBD engine with N jobs (one connection each, so one per
worker), each job on its own 1/N of the export (swap never writes one page from two
connections at once). Per test: requests a second over all jobs, its ratio to one worker's,
and the CPU every worker process together spent per request (the daemon's, not the
memservers'). Medians of `--reps` runs, the order of the N interleaved in each.

    uv run python benchmarks/bench_workers.py                      # 1 and 2 workers, here
    uv run python benchmarks/bench_workers.py --workers 1,2,4,8 \\
        --daemon-cpus 0-7 --fio-cpus 8-11 --memserver-cpus 12-15   # a 16-core machine

The target of issue 50, part 2: at N = 4, at least 0.7 x 4 times one worker's requests, where
the cores exist; on two cores, no more CPU per request with 2 workers than with 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_nbd import cpu_seconds, loadavg, machine, wait_for_line, wait_for_socket
from cpusteal import cpu_times, steal_percent

MiB = 1 << 20
TESTS = [("randwrite", 16), ("randread", 16)]


def _pin(cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus] if cpus else []


def _workers_of(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(x) for x in (task / "children").read_text().split()]
    return [pid, *kids]


class Daemon:
    """Two memservers and a deployed daemon with `workers` workers, on `tmp`."""

    def __init__(self, tmp: str, size: int, workers: int, args: argparse.Namespace) -> None:
        py = [sys.executable, "-m", "duvm.cli"]
        self.procs: list[subprocess.Popen] = []
        secret = os.path.join(tmp, "secret")
        if not os.path.exists(secret):
            subprocess.run([*py, "secret", "generate", secret], check=True)
        peers = []
        for _ in range(2):
            ms = subprocess.Popen(
                [
                    *_pin(args.memserver_cpus),
                    *(*py, "memserver", "--listen", "127.0.0.1:0"),
                    *("--capacity", str(size + 64 * MiB), "--secret-file", secret),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            self.procs.append(ms)
            port = wait_for_line(ms, r"listening on [\d.]+:(\d+)").group(1)
            peers.append(f"127.0.0.1:{port}")
        self.sock = os.path.join(tmp, f"w{workers}.sock")
        state = os.path.join(tmp, f"state-w{workers}")
        self.daemon = subprocess.Popen(
            [
                *_pin(args.daemon_cpus),
                *(*py, "daemon", "--peers", ",".join(peers), "--size", str(size)),
                *("--socket", self.sock, "--replicas", "2", "--encrypt"),
                *("--secret-file", secret, "--state-dir", state, "--workers", str(workers)),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(self.daemon)
        wait_for_line(self.daemon, "serving", timeout=120)
        wait_for_socket(self.sock, self.daemon)
        self.pids = _workers_of(self.daemon.pid)
        if len(self.pids) != workers:
            raise RuntimeError(f"{workers} workers asked, {len(self.pids)} running")

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids)

    def own_kib(self) -> list[int]:
        """Each worker's own memory (RssAnon: what another worker costs the node)."""
        out = []
        for pid in self.pids:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    out.append(int(line.split()[1]))
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):  # the daemon first, so it can release
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def fio(d: Daemon, jobs: int, rw: str, qd: int, size: int, args: argparse.Namespace) -> dict:
    part = size // jobs
    cmd = [
        *_pin(args.fio_cpus),
        *("fio", "--name=w", "--ioengine=nbd", f"--uri=nbd+unix:///?socket={d.sock}"),
        *(f"--rw={rw}", "--bs=4k", f"--iodepth={qd}", f"--numjobs={jobs}"),
        *(f"--size={part}", f"--offset_increment={part}", "--group_reporting"),
        *("--time_based", f"--runtime={args.runtime}", "--norandommap", "--randrepeat=0"),
        "--output-format=json",
    ]
    before = d.cpu()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    spent = d.cpu() - before
    side = json.loads(out[out.index("{") :])["jobs"][0]["read" if "read" in rw else "write"]
    n = side["total_ios"]
    return {"iops": side["iops"], "requests": n, "daemon_cpu_us": spent / n * 1e6}


def fill(d: Daemon, jobs: int, size: int) -> None:
    """Every page written once, so reads find data (never-written pages are zeros unread)."""
    part = size // jobs
    subprocess.run(
        [
            *("fio", "--name=fill", "--ioengine=nbd", f"--uri=nbd+unix:///?socket={d.sock}"),
            *("--rw=write", "--bs=256k", "--iodepth=4", f"--numjobs={jobs}"),
            *(f"--size={part}", f"--offset_increment={part}", "--output-format=json"),
        ],
        capture_output=True,
        check=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (1,2)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=4, help="seconds per fio run")
    ap.add_argument("--size", default="256M", help="export size (default 256M)")
    ap.add_argument("--daemon-cpus", help="taskset list for the daemon's workers")
    ap.add_argument("--fio-cpus", help="taskset list for fio")
    ap.add_argument("--memserver-cpus", help="taskset list for the memservers")
    ap.add_argument("--json", help="write raw and median results here")
    args = ap.parse_args()
    from duvm.base.units import parse_size

    size = parse_size(args.size)
    try:
        counts = [int(w) for w in args.workers.split(",") if w]
    except ValueError:
        ap.error(f"--workers takes numbers, not {args.workers!r}")
    if not counts or any(not 1 <= w <= 64 for w in counts):
        ap.error("--workers takes counts from 1 to 64")
    if any(size % (w * 4096) for w in counts):
        ap.error("--size must split into whole pages for each worker count")
    if shutil.which("fio") is None:
        print("bench_workers: fio is not installed", file=sys.stderr)
        return 2
    info = machine()
    tmp = tempfile.mkdtemp(prefix="bench-workers-", dir="/dev/shm")
    raw: dict[str, dict[int, list[dict]]] = {}
    own: dict[int, list[int]] = {}
    daemons: dict[int, Daemon] = {}
    try:
        for w in counts:
            daemons[w] = Daemon(tmp, size, w, args)
            fill(daemons[w], w, size)
        for rep in range(args.reps):
            for rw, qd in TESTS:
                order = counts if rep % 2 == 0 else list(reversed(counts))
                for w in order:
                    r = fio(daemons[w], w, rw, qd, size, args)
                    raw.setdefault(f"{rw}{qd}", {}).setdefault(w, []).append(r)
                    print(
                        f"rep {rep + 1} {rw} QD{qd}x{w} {w} workers: {r['iops']:.0f} IOPS, "
                        f"{r['daemon_cpu_us']:.1f} us daemon CPU/request",
                        flush=True,
                    )
        own = {w: d.own_kib() for w, d in daemons.items()}
    finally:
        for d in daemons.values():
            d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    info["loadavg_end"] = loadavg()
    info["steal_pct"] = steal_percent(info.pop("cpu_times_start"), cpu_times())
    median = {
        t: {w: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for w, runs in d.items()}
        for t, d in raw.items()
    }
    print(f"\n{info['cpu']}, {info['cpus']} CPUs, steal {info['steal_pct']} %")
    for w, kib in own.items():
        print(f"{w} workers: own memory (RssAnon) per worker, MiB: {[k >> 10 for k in kib]}")
    print("| test | workers (fio jobs) | IOPS | vs 1 worker | daemon CPU µs/request |")
    print("|---|---|---|---|---|")
    for t, d in median.items():
        one = d.get(1, {}).get("iops")
        for w, m in d.items():
            ratio = f"{m['iops'] / one:.2f}x" if one else "n/a"
            print(f"| 4 KiB {t} | {w} | {m['iops']:,.0f} | {ratio} | {m['daemon_cpu_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "raw": raw, "median": median, "own_kib": own}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
