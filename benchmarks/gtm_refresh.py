"""Cost of gputaskman's per-process probes and of one refresh with N processes running.

Usage::

    uv run python benchmarks/gtm_refresh.py            # N=1000 idle processes
    uv run python benchmarks/gtm_refresh.py -n 200 --repeat 5

What it does
------------
1. Spawns N idle processes: N-M ``sleep`` processes plus M (default 10) small Pythons that
   memory-map a real GGUF file (written with the ``gguf`` package) and name it with ``-m``,
   so the scanner has real model evidence to find. Exactly these processes are killed (by
   their Popen objects) at the end, also on error or Ctrl+C.
2. Per-probe costs: each probe is timed over every spawned process (``time.perf_counter``
   around one call), and the median in microseconds is printed. Probes: list /proc, read
   and parse ``stat``, read ``statm``, the host sampler's whole per-process pass, psutil's
   ``process_iter`` with the same fields (for comparison), ``maps`` read / parse /
   runtime detection, ``cmdline`` read + redaction + model arguments, ``cwd``/``exe``
   readlinks, and one full ``procinfo.scan_process``. Machine-wide probes (meminfo, swaps,
   /proc/stat, loadavg) are timed ``--repeat`` x 20 times each.
3. Refreshes: with ``gputaskman.sampling.collector.Collector`` when it exists (its ``last_timing``
   splits GPU, host and scan time), otherwise ``HostSampler`` + ``procscan.Scanner``:
   a cold refresh (empty cache, budget 0.150 s), the refreshes until every process is
   scanned, a warm refresh (everything cached), and a one-shot refresh (budget None).

The machine is shared (2 vCPUs, other work running), so medians are printed, and every
figure is wall time of this process on this machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil
from gputaskman.base import procargs, procfs
from gputaskman.intel import procinfo, procscan
from gputaskman.sampling import host

MAPPER = r"""
import mmap, sys, time
f = open(sys.argv[2], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
sys.stdout.write("ready\n"); sys.stdout.flush()
time.sleep(3600)
"""


def write_gguf(path: Path) -> None:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def spawn(n: int, mappers: int, workdir: Path) -> list[subprocess.Popen[bytes]]:
    model = workdir / "bench.gguf"
    write_gguf(model)
    procs: list[subprocess.Popen[bytes]] = []
    sleep = shutil.which("sleep") or "/bin/sleep"
    try:
        for _ in range(mappers):
            p = subprocess.Popen(
                [sys.executable, "-c", MAPPER, "-m", str(model)],
                stdout=subprocess.PIPE,
                cwd=workdir,
            )
            procs.append(p)
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != b"ready":
                raise RuntimeError("a mapper child failed to start")
        for _ in range(n - mappers):
            procs.append(subprocess.Popen([sleep, "3600"], stdin=subprocess.DEVNULL))
    except BaseException:
        kill(procs)
        raise
    return procs


def kill(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


def per_process(pids: list[int], fn: Callable[[int], Any]) -> float:
    """Median microseconds of fn(pid) over pids."""
    times = []
    clock = time.perf_counter
    for pid in pids:
        t = clock()
        with contextlib.suppress(procfs.ProcError):
            fn(pid)
        times.append(clock() - t)
    return statistics.median(times) * 1e6


def repeated(n: int, fn: Callable[[], Any]) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def read_maps_text(pid: int) -> str:
    return procfs.read_proc(pid, "maps").decode("utf-8", "replace")


def cmdline_probe(pid: int) -> None:
    red = procargs.redact_argv(procargs.split_cmdline(procfs.read_proc(pid, "cmdline")))
    procargs.model_args(red)


def psutil_pass() -> int:
    """psutil's cheapest way to the same fields (its per-process objects are cached)."""
    return sum(
        1 for _ in psutil.process_iter(["pid", "name", "create_time", "memory_info", "cpu_times"])
    )


def row(name: str, value: float, unit: str, how: str) -> None:
    print(f"  {name:<44} {value:>10.1f} {unit:<9} {how}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=1000, help="idle processes to spawn (default 1000)")
    ap.add_argument("--mappers", type=int, default=10, help="of which map a GGUF (default 10)")
    ap.add_argument("--repeat", type=int, default=3, help="repetitions of whole-pass probes")
    ap.add_argument("--budget", type=float, default=0.150, help="scan budget in seconds")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gtm-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        t = time.perf_counter()
        procs = spawn(args.n, min(args.mappers, args.n), workdir)
        print(
            f"spawned {len(procs)} processes in {time.perf_counter() - t:.2f} s "
            f"({min(args.mappers, args.n)} map a GGUF); total processes on the machine: "
            f"{len(procfs.list_pids())}; {os.cpu_count()} CPUs; load "
            f"{os.getloadavg()[0]:.2f}"
        )
        time.sleep(0.5)  # let the children settle into their sleep
        gc.disable()
        run(procs, args)
    finally:
        gc.enable()
        kill(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run(procs: list[subprocess.Popen[bytes]], args: argparse.Namespace) -> None:
    pids = [p.pid for p in procs]
    mapper_pids = pids[: args.mappers]
    total = len(procfs.list_pids())
    btime = procfs.boot_time()

    print("\nper-process probes (median over the spawned processes, microseconds)")
    row("read+parse /proc/PID/stat", per_process(pids, procfs.read_stat), "us/proc", "procfs")
    row(
        "read /proc/PID/statm",
        per_process(pids, lambda p: procfs.read_proc(p, "statm")),
        "us/proc",
        "procfs",
    )
    row(
        "read /proc/PID/maps (sleep)",
        per_process(pids[args.mappers :], read_maps_text),
        "us/proc",
        "procfs",
    )
    row(
        "read /proc/PID/maps (python+gguf)",
        per_process(mapper_pids, read_maps_text),
        "us/proc",
        "procfs",
    )
    texts = {p: read_maps_text(p) for p in mapper_pids}
    row(
        "parse maps -> paths+runtimes+models (python)",
        per_process(
            mapper_pids,
            lambda p: (
                procinfo.detect_runtimes(ps := procinfo.mapped_paths(texts[p])),
                procinfo.mapped_models(ps),
            ),
        ),
        "us/proc",
        "sans-io",
    )
    row(
        "read cmdline + redact + model args",
        per_process(pids, cmdline_probe),
        "us/proc",
        "procargs",
    )
    row(
        "readlink cwd + exe",
        per_process(
            pids, lambda p: (procfs.readlink_proc(p, "cwd"), procfs.readlink_proc(p, "exe"))
        ),
        "us/proc",
        "procfs",
    )
    row(
        "scan_process (sleep)",
        per_process(pids[args.mappers :], lambda p: procinfo.scan_process(p, btime=btime)),
        "us/proc",
        "procinfo",
    )
    row(
        "scan_process (python+gguf)",
        per_process(mapper_pids, lambda p: procinfo.scan_process(p, btime=btime)),
        "us/proc",
        "procinfo",
    )
    row(
        "psutil.Process(pid).open_files() (NOT used)",
        per_process(mapper_pids[:3], lambda p: psutil.Process(p).open_files()),
        "us/proc",
        "reference",
    )

    print(
        f"\nwhole per-process passes over all {total} processes (median of "
        f"{args.repeat}, microseconds per process)"
    )
    sampler = host.HostSampler()
    sampler.processes()
    t_host = repeated(args.repeat, sampler.processes) / total
    row("HostSampler.processes() (stat+statm)", t_host, "us/proc", "chosen")
    t_ps = repeated(args.repeat, psutil_pass) / total
    row("psutil.process_iter(name,ctime,mem,cpu)", t_ps, "us/proc", "comparison")
    row("list /proc", repeated(20, procfs.list_pids), "us/ref", "fixed")

    print("\nmachine-wide probes (median of 20, microseconds per refresh)")
    row(
        "meminfo read + parse",
        repeated(20, lambda: host.parse_meminfo(Path(host.MEMINFO).read_text())),
        "us/ref",
        "fixed",
    )
    row(
        "/proc/swaps read + parse",
        repeated(20, lambda: host.parse_swaps(Path(host.SWAPS).read_text())),
        "us/ref",
        "fixed",
    )
    row(
        "/proc/stat cpu line",
        repeated(20, lambda: host.parse_cpu_line(Path(host.STAT).read_text())),
        "us/ref",
        "fixed",
    )
    row("loadavg", repeated(20, os.getloadavg), "us/ref", "fixed")
    row(
        "HostSampler.sample() (machine + all procs)",
        repeated(args.repeat, sampler.sample),
        "us/ref",
        "fixed+per-proc",
    )

    refreshes(args)


def refreshes(args: argparse.Namespace) -> None:
    budget = args.budget
    try:
        from gputaskman.sampling.collector import Collector
    except ImportError:
        Collector = None  # type: ignore[assignment,misc]
    print(f"\nrefreshes (budget {budget * 1000:.0f} ms for maps scanning; milliseconds)")
    if Collector is not None:
        col = Collector(scan_budget=budget)
        results = []
        while True:
            col.sample_with_system()
            tm = dict(col.last_timing)
            res = getattr(getattr(col, "_scanner", None), "last_result", None)
            results.append((tm, res))
            if res is None or not res.pending or len(results) > 200:
                break
        cold, cold_res = results[0]
        print(f"  using gputaskman.sampling.collector.Collector (backend {col.backend})")
        _print_timing("cold refresh (empty cache)", cold, cold_res)
        print(f"  refreshes until every process was scanned: {len(results)}")
        col.sample_with_system()
        _print_timing(
            "warm refresh (all cached)", col.last_timing, getattr(col._scanner, "last_result", None)
        )
        models = getattr(col, "models", None)
        if models is not None:
            # model looks (API probe, GGUF header, logs) run on background threads; wait
            # for them, then time a refresh that builds every row's view from the cache
            t0 = time.perf_counter()
            models.wait_idle(60)
            print(
                f"  background model looks finished {1000 * (time.perf_counter() - t0):.0f}"
                " ms after the warm refresh"
            )
            col.sample_with_system()
            _print_timing(
                "warm refresh, models known",
                col.last_timing,
                getattr(col._scanner, "last_result", None),
            )
            costs = sorted(models.costs())
            if costs:
                print(
                    f"  model look per process (background thread): median "
                    f"{statistics.median(costs) * 1000:.1f} ms, max {costs[-1] * 1000:.1f} ms"
                    f" over {len(costs)} processes with model evidence or an LLM runtime"
                )
        one = Collector(scan_budget=None)
        one.sample_with_system()
        _print_timing(
            "one-shot (budget None, cold)",
            one.last_timing,
            getattr(one._scanner, "last_result", None),
        )
        col.close()
        one.close()
        return
    sampler = host.HostSampler()
    scanner = procscan.Scanner(budget)
    n = 0
    while True:
        t0 = time.perf_counter()
        info = sampler.sample()
        t1 = time.perf_counter()
        res = scanner.scan([(p.pid, p.create_time) for p in info.processes.values()])
        t2 = time.perf_counter()
        n += 1
        if n == 1:
            _print_timing(
                "cold refresh (empty cache)",
                {"host_s": t1 - t0, "scan_s": t2 - t1, "total_s": t2 - t0},
                res,
            )
        if not res.pending:
            break
    print(f"  refreshes until every process was scanned: {n}")


def _print_timing(label: str, tm: dict[str, float], res: Any) -> None:
    parts = "  ".join(f"{k[:-2]} {v * 1000:7.1f}" for k, v in tm.items())
    extra = ""
    if res is not None:
        extra = (
            f"  [scanned {res.scanned}, pending {len(res.pending)}, "
            f"scan elapsed {res.elapsed_s * 1000:.1f}, cache {res.cache_size}]"
        )
    print(f"  {label:<30} {parts}{extra}")


if __name__ == "__main__":
    sys.exit(main())
