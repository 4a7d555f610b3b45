#!/usr/bin/env python3
"""Benchmark duvm's NBD data path against `nbdkit memory`, the C reference NBD server.

One run, servers interleaved, median of N repetitions (default 3):

* 4 KiB random read and write at queue depth 1 and 16, fio's `nbd` engine, one connection;
* 256 KiB sequential read and write with nbdcopy (file in /dev/shm -> export, export -> null:).

Targets, all on one Unix socket each:

* `duvm-deployed` what `duvm enable` runs on a cluster: the daemon, two memservers on loopback,
  two copies of each page, pages encrypted (AES-GCM), peers authenticated by a cluster secret;
* `duvm`        duvm daemon + one memserver on loopback, one copy, plain (two hops);
* `nbdkit`      `nbdkit memory` (reference);
* `duvm-local`  duvm daemon over its in-RAM store (one hop: shows where the time goes);
* `duvm-base`, `duvm-local-base`: the same, run from another checkout (`--baseline DIR`, e.g. a
  `git worktree` of the commit before a change), side by side with this one in the same run;
* `duvm-deployed-pure`: the deployed target on the pure-Python path (`DUVM_PURE_PYTHON=1`), to
  compare the reference with the compiled path in one run;
* `duvm-deployed-rdma`: the deployed target with its pages moved by RDMA: both memservers
  listen on `--rdma-host IP` (an address of a verbs device's netdev) with `--rdma on`, and the
  daemon names them `rdma://`. On an RDMA NIC, run it beside `duvm-deployed` and `nbdkit`.

For each run it reports IOPS or MiB/s, the ratio to nbdkit, the mean latency (fio), and the
CPU time each process spent per request (utime+stime deltas from /proc/PID/stat for servers,
wait4 rusage for the client). The client is pinned to one CPU and every server to the other
(taskset), since placement changes QD1 results several-fold on a 2-core VM.

Usage: uv run python benchmarks/bench_nbd.py [--reps 3] [--runtime 4] [--size 512M]
                                             [--json out.json] [--markdown out.md]
                          [--baseline DIR --targets duvm-deployed,duvm-deployed-base,nbdkit]
                          [--rdma-host IP --targets duvm-deployed,duvm-deployed-rdma,nbdkit]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from cpusteal import cpu_times, steal_percent  # benchmarks/, next to this script

MiB = 1 << 20
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime+stime of a process and its threads, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


@dataclass
class Target:
    name: str
    uri: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)


def wait_for_line(proc: subprocess.Popen, pattern: str, timeout: float = 30) -> re.Match:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode}")
            continue
        m = re.search(pattern, line)
        if m:
            return m
    raise TimeoutError(f"no line matching {pattern!r}")


def wait_for_socket(path: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.05)


def start_targets(
    tmp: str,
    size: int,
    server_cpu: str,
    memserver_cpu: str,
    want: list[str],
    baseline: str | None = None,
    rdma_host: str | None = None,
) -> list[Target]:
    py = [sys.executable, "-m", "duvm.cli"]
    pin = ["taskset", "-c", server_cpu]
    targets = []
    for full in want:
        sock = os.path.join(tmp, f"{full}.sock")
        t = Target(full, f"nbd+unix:///?socket={sock}")
        name, env, rdma = full, None, False
        if full.endswith("-rdma"):  # memservers on an RDMA netdev's address, peers rdma://
            name, rdma = full.removesuffix("-rdma"), True
        elif full.endswith("-base"):  # the other checkout's duvm comes first on the path
            name = full.removesuffix("-base")
            env = dict(os.environ, PYTHONPATH=os.path.join(baseline or "", "packages/duvm/src"))
        elif full.endswith("-pure"):  # the reference path (duvm.base.accel)
            name = full.removesuffix("-pure")
            env = dict(os.environ, DUVM_PURE_PYTHON="1")
        if name == "nbdkit":
            t.procs["nbdkit"] = subprocess.Popen(
                [*pin, "nbdkit", "-f", "-U", sock, "memory", str(size)]
            )
            wait_for_socket(sock, t.procs["nbdkit"])
        elif name == "duvm-local":
            t.procs["daemon"] = subprocess.Popen(
                [*pin, *py, "daemon", "--memory", "--size", str(size), "--socket", sock],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            wait_for_line(t.procs["daemon"], "serving")
        elif name in ("duvm", "duvm-deployed"):
            # deployed: what `duvm enable` runs on a cluster (2 memservers, 2 copies, pages
            # encrypted, peers authenticated by the cluster secret)
            deployed = name == "duvm-deployed"
            security: list[str] = []
            if deployed:
                secret = os.path.join(tmp, f"{full}.secret")
                subprocess.run([*py, "secret", "generate", secret], check=True, env=env)
                security = ["--secret-file", secret]
            peers = []
            host = rdma_host if rdma else "127.0.0.1"
            for i in range(2 if deployed else 1):
                ms = subprocess.Popen(
                    [
                        *("taskset", "-c", memserver_cpu, *py, "memserver"),
                        *("--listen", f"{host}:0", "--capacity", str(size + 64 * MiB)),
                        *(("--rdma", "on") if rdma else ()),
                        *security,
                    ],
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                t.procs["memserver" if not deployed else f"memserver{i}"] = ms
                port = wait_for_line(ms, r"listening on [\d.]+:(\d+)").group(1)
                peers.append(f"{'rdma://' if rdma else ''}{host}:{port}")
            extra = ["--replicas", "2", "--encrypt", *security] if deployed else []
            t.procs["daemon"] = subprocess.Popen(
                [
                    *(*pin, *py, "daemon", "--peers", ",".join(peers)),
                    *("--size", str(size), "--socket", sock, *extra),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            wait_for_line(t.procs["daemon"], "serving")
        targets.append(t)
    return targets


def stop_targets(targets: list[Target]) -> None:
    """SIGTERM each process and wait, the daemon before its memserver (so it can RELEASE)."""
    for t in targets:
        for p in reversed(list(t.procs.values())):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_client(cmd: list[str], target: Target) -> tuple[str, float, dict[str, float], float]:
    """Run a client to completion -> (stdout, wall s, server CPU s by process, client CPU s)."""
    before = {k: cpu_seconds(p.pid) for k, p in target.procs.items()}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode:
        raise RuntimeError(f"{cmd[3]} failed on {target.name}: {err.strip()[-500:]}")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu = ru.ru_utime + ru.ru_stime  # cumulative; caller takes deltas
    after = {k: cpu_seconds(p.pid) for k, p in target.procs.items()}
    return out, wall, {k: after[k] - before[k] for k in before}, client_cpu


def fio_test(target: Target, rw: str, qd: int, args: argparse.Namespace) -> dict:
    cmd = [
        "taskset",
        "-c",
        args.client_cpu,
        "fio",
        "--name=b",
        "--ioengine=nbd",
        f"--uri={target.uri}",
        f"--rw={rw}",
        "--bs=4k",
        f"--iodepth={qd}",
        f"--size={args.size}",
        "--time_based",
        f"--runtime={args.runtime}",
        "--norandommap",
        "--randrepeat=0",
        "--output-format=json",
    ]
    c0 = client_cpu_total()
    out, _, cpu, _ = run_client(cmd, target)
    client = client_cpu_total() - c0
    job = json.loads(out[out.index("{") :])["jobs"][0]
    side = job["read" if "read" in rw else "write"]
    n = side["total_ios"]
    return {
        "iops": side["iops"],
        "lat_us": side["lat_ns"]["mean"] / 1000,
        "requests": n,
        "cpu_us": {k: v / n * 1e6 for k, v in cpu.items()} | {"client": client / n * 1e6},
    }


def copy_test(target: Target, direction: str, src: str, args: argparse.Namespace) -> dict:
    common = ["taskset", "-c", args.client_cpu, "nbdcopy", "--request-size=262144"]
    if direction == "write":
        cmd = [*common, src, target.uri]
    else:
        cmd = [*common, "--no-extents", target.uri, "null:"]
    c0 = client_cpu_total()
    _, wall, cpu, _ = run_client(cmd, target)
    client = client_cpu_total() - c0
    n = args.size // 262144
    return {
        "mib_s": args.size / MiB / wall,
        "requests": n,
        "cpu_us": {k: v / n * 1e6 for k, v in cpu.items()} | {"client": client / n * 1e6},
    }


def client_cpu_total() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def machine() -> dict:
    def cmd(*a: str) -> str:
        try:
            return subprocess.run(a, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return "n/a"

    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in cmd("lscpu").splitlines()
            if ln.startswith("Model name")
        ),
        "n/a",
    )
    try:
        import uvloop

        uv = uvloop.__version__
    except ImportError:
        uv = "not installed"
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "uvloop": uv,
        "nbdkit": cmd("nbdkit", "--version"),
        "fio": cmd("fio", "--version"),
        "nbdcopy": cmd("nbdcopy", "--version").splitlines()[0]
        if shutil.which("nbdcopy")
        else "n/a",
        "loadavg_start": loadavg(),
        "cpu_times_start": cpu_times(),
    }


def loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


TESTS = [
    ("randread", 1),
    ("randread", 16),
    ("randwrite", 1),
    ("randwrite", 16),
    ("seqread", 0),
    ("seqwrite", 0),
]


def label(test: str, qd: int) -> str:
    return {"seqread": "256 KiB seq read", "seqwrite": "256 KiB seq write"}.get(
        test, f"4 KiB {test} QD{qd}"
    )


def markdown(results: dict, info: dict, args: argparse.Namespace) -> str:
    order = (
        "duvm-deployed",
        "duvm-deployed-pure",
        "duvm-deployed-base",
        "duvm",
        "duvm-base",
        "nbdkit",
        "duvm-local",
        "duvm-local-base",
    )
    names = [n for n in order if n in results["targets"]]
    steal = "n/a" if info.get("steal_pct") is None else f"{info['steal_pct']}%"
    lines = [
        f"Machine: {info['cpu']}, {info['cpus']} CPUs, kernel {info['kernel']}, "
        f"Python {info['python']}, uvloop {info['uvloop']}, {info['nbdkit']}, {info['fio']}, "
        f"{info['nbdcopy']}. Load average at start {' '.join(info['loadavg_start'])}, at end "
        f"{' '.join(info['loadavg_end'])}; CPU steal over the whole run {steal}.",
        f"Placement (taskset): client on CPU {args.client_cpu}, nbdkit and the daemon on CPU "
        f"{args.server_cpu}, the memserver on CPU {args.memserver_cpu or args.server_cpu}. "
        f"Export {args.size // MiB} MiB, prefilled; fio "
        f"{args.runtime}s per run, one connection; nbdcopy 256 KiB requests, its default "
        "connections and requests in flight. Median of "
        f"{args.reps} interleaved runs.",
        "",
        "| test | target | result | vs nbdkit | mean latency | CPU µs/request (per process) |",
        "|---|---|---|---|---|---|",
    ]
    for test, qd in TESTS:
        key = f"{test}{qd or ''}"
        base = results["median"].get(key, {}).get("nbdkit")
        for n in names:
            r = results["median"].get(key, {}).get(n)
            if r is None:
                continue
            metric = "iops" if "iops" in r else "mib_s"
            val = f"{r[metric]:,.0f} IOPS" if metric == "iops" else f"{r[metric]:,.0f} MiB/s"
            ratio = f"{r[metric] / base[metric]:.2f}x" if base else "n/a"
            lat = f"{r['lat_us']:.1f} µs" if "lat_us" in r else "n/a"
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_us"].items())
            lines.append(f"| {label(test, qd)} | {n} | {val} | {ratio} | {lat} | {cpu} |")
    return "\n".join(lines)


def median_result(runs: list[dict]) -> dict:
    out: dict = {}
    for k in runs[0]:
        if isinstance(runs[0][k], dict):
            out[k] = {kk: statistics.median(r[k][kk] for r in runs) for kk in runs[0][k]}
        else:
            out[k] = statistics.median(r[k] for r in runs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runtime", type=int, default=4, help="seconds per fio run")
    ap.add_argument("--size", default="512M", help="export size (default 512M)")
    ap.add_argument("--client-cpu", default="0")
    ap.add_argument("--server-cpu", default="1")
    ap.add_argument(
        "--memserver-cpu",
        help="CPU of the memserver (default: --server-cpu; "
        "the client's CPU stands in for a memserver on another node)",
    )
    ap.add_argument(
        "--targets",
        default="duvm-deployed,duvm,nbdkit,duvm-local",
        help="comma-separated, from duvm-deployed, duvm-deployed-pure, duvm, nbdkit, "
        "duvm-local (and with --baseline their -base twins, with --rdma-host "
        "duvm-deployed-rdma)",
    )
    ap.add_argument(
        "--rdma-host",
        metavar="IP",
        help="an address of this machine's RDMA netdev: enables the target duvm-deployed-rdma",
    )
    names = [f"{t}{q or ''}" for t, q in TESTS]
    ap.add_argument(
        "--tests",
        default=",".join(names),
        help=f"comma-separated, from {','.join(names)} (default: all)",
    )
    ap.add_argument(
        "--baseline",
        help="another checkout of this repository, run as the targets duvm-base and "
        "duvm-local-base (e.g. `git worktree add /tmp/base COMMIT`)",
    )
    ap.add_argument("--json", help="write raw and median results here")
    ap.add_argument("--markdown", help="write the table here")
    args = ap.parse_args()
    from duvm.base.units import parse_size

    args.size = parse_size(args.size)
    for tool in ("fio", "nbdcopy", "nbdkit", "taskset"):
        if shutil.which(tool) is None:
            print(f"bench_nbd: {tool} is not installed", file=sys.stderr)
            return 2
    want = [t for t in args.targets.split(",") if t]
    if "duvm" in want:
        try:
            import duvm.store.remote_store  # noqa: F401
        except ImportError:
            print(
                "bench_nbd: duvm.store.remote_store is missing; skipping the two-hop target",
                file=sys.stderr,
            )
            want.remove("duvm")
    asked = [t for t in args.tests.split(",") if t]
    known = ["duvm-deployed", "duvm-deployed-pure", "duvm", "nbdkit", "duvm-local"]
    if args.baseline:
        if not os.path.isdir(os.path.join(args.baseline, "packages/duvm/src/duvm")):
            ap.error(f"--baseline {args.baseline} is not a checkout of this repository")
        known += ["duvm-deployed-base", "duvm-base", "duvm-local-base"]
    if args.rdma_host:
        known.append("duvm-deployed-rdma")
    unknown = [t for t in asked if t not in names] + [t for t in want if t not in known]
    if unknown or not asked or not want:
        ap.error(
            f"unknown test(s) or target(s): {','.join(unknown)}"
            if unknown
            else "--tests and --targets must name at least one each"
        )
    tests = [(t, q) for t, q in TESTS if f"{t}{q or ''}" in asked]
    info = machine()
    tmp = tempfile.mkdtemp(
        prefix="bench-nbd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    src = os.path.join(tmp, "src.bin")
    with open(src, "wb") as f:
        for _ in range(args.size // (16 * MiB)):
            f.write(os.urandom(16 * MiB))
    targets = []
    raw: dict = {}
    try:
        targets = start_targets(
            tmp,
            args.size,
            args.server_cpu,
            args.memserver_cpu or args.server_cpu,
            want,
            args.baseline,
            args.rdma_host,
        )
        for t in targets:  # prefill: reads must not hit never-written (zero) blocks
            copy_test(t, "write", src, args)
        for rep in range(args.reps):
            for test, qd in tests:
                key = f"{test}{qd or ''}"
                for t in targets:
                    if test.startswith("seq"):
                        r = copy_test(t, test[3:], src, args)
                    else:
                        r = fio_test(t, test, qd, args)
                    raw.setdefault(key, {}).setdefault(t.name, []).append(r)
                    shown = f"{r['iops']:.0f} IOPS" if "iops" in r else f"{r['mib_s']:.0f} MiB/s"
                    print(f"rep {rep + 1} {label(test, qd):22} {t.name:10} {shown}", flush=True)
    finally:
        stop_targets(targets)
        shutil.rmtree(tmp, ignore_errors=True)
    info["loadavg_end"] = loadavg()
    info["steal_pct"] = steal_percent(info.pop("cpu_times_start"), cpu_times())
    results = {
        "machine": info,
        "targets": [t.name for t in targets],
        "raw": raw,
        "median": {k: {n: median_result(v) for n, v in d.items()} for k, d in raw.items()},
    }
    table = markdown(results, info, args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
