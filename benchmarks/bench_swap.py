#!/usr/bin/env python3
"""Benchmark kernel swapping through duvm against other swap targets: the `duvm demo` workload.

Usage (root; it creates swap devices, loop devices, FUSE mounts and cgroups):

    sudo uv run python benchmarks/bench_swap.py [--reps 3] [--mib 256] [--limit-mib 64]
        [--targets duvm-1,duvm-3,duvm-3r2,nbdkit,duvm-local,disk-file,zram,no-swap]
        [--json F] [--markdown F]

Theory of operation
-------------------
The workload is the demo's (:mod:`duvm.cli.workload`): it holds ``--mib`` MiB of incompressible
random data in a memory cgroup (:mod:`duvm.base.cgroup`) limited to ``--limit-mib`` (4x by default),
so the kernel swaps most of it out while it fills (the *fill* phase, mostly swap-out) and back
in while it reads every byte to verify it (the *verify* phase, mostly swap-in). The workload
times both phases itself; this script times the whole process (wall), reads ``pswpout`` and
``pswpin`` from /proc/vmstat before, at the end of the fill phase (seen on the workload's
``--progress`` line) and after, and polls /proc/swaps for the peak use of the device under test.

Targets, one swap device each at the highest swap priority (32767), so the workload's pages go
to the device under test and nowhere else:

* ``duvm-1``, ``duvm-3``: ``duvm enable`` (daemon + 1 or 3 memservers on loopback, one copy of
  each page), through duvm's own attach (:mod:`duvm.node.attach.attach`);
* ``duvm-3r2``: the same with 3 memservers and two copies of each page, the default of
  ``duvm enable`` and ``duvm demo`` with 3 peers (every swapped-out page is sent twice);
* ``nbdkit``: ``nbdkit memory`` (the C reference NBD server) on a Unix socket, attached by the
  SAME :func:`duvm.node.attach.attach.attach` call, so it goes through the same frontend as duvm:
  kernel nbd where the kernel has it, else nbdfuse + a loop device with direct I/O (this project's
  VM: no nbd module). ``duvm-3 / nbdkit`` is the issue's target ratio (<= 1.15x);
* ``duvm-local``: ``duvm daemon --memory``, the same NBD server over its in-RAM store (one hop,
  no memserver), attached the same way: it separates what the Python NBD layer costs from
  what the second hop to the memservers costs;
* ``disk-file``: a swap file on local disk (``--disk-dir``), swapon'd directly. Its frontend
  differs ON PURPOSE: the kernel's own swap-file path (bios straight to the file's blocks, no
  page cache) is how anyone uses a swap file; a loop device over it would add a layer nobody
  uses and still not be the NBD frontend. It is the "local disk" reference, not a like-for-like
  comparison of servers;
* ``zram``: the kernel's compressed RAM block device (/dev/zram0 when free, else a hot-added
  one), swapon'd directly (kernel frontend, like disk-file). The data is random, so zram cannot
  compress it: this is the cost of a RAM-backed kernel block device;
* ``no-swap``: the same workload in a cgroup limited only by RAM: no swapping, the floor (the
  workload's own CPU time for generating and hashing the data).

Repetitions are interleaved (every target once per round, the round order rotated each time)
and each figure is the median over the successful runs of a target, taken per column. Every
target is set up before its run and torn down right after (swapoff, loop detach, FUSE unmount,
zram reset, file removal, processes stopped by PID, cgroup removed), also on errors, Ctrl-C and
SIGTERM; after each run the script checks that nothing of it is left and records what was.

The script refuses to start when it is not root, when a tool a chosen target needs is missing,
or when another swap device is already active at priority 32767 (the kernel would share the
workload's pages with it). Swap devices at lower priorities are reported but do not matter: the
device under test is never full (``--size``, default 1.5x the workload).

Numbers depend on what else runs: the load average at start and end is printed and recorded,
and so is the CPU steal of each run (/proc/stat: time the hypervisor gave other guests; on this
project's VM it reached 20-45% for minutes at a time and doubled every target's wall time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cpusteal import cpu_times, steal_percent  # benchmarks/, next to this script
from duvm.base import cgroup
from duvm.base.units import parse_size
from duvm.cli import demo
from duvm.node.attach import attach, attach_kernel, attach_state, kernel_swap, processes, systools
from duvm.node.lifecycle import control

PRIORITY = demo.MAX_PRIORITY  # the highest: the kernel uses the device under test first
MiB = 1 << 20
PAGE = 4096
TARGETS = ("duvm-1", "duvm-3", "duvm-3r2", "nbdkit", "duvm-local", "disk-file", "zram", "no-swap")
SWAP_FILE_FS = ("ext2", "ext3", "ext4", "xfs")  # take a plain swap file without extra flags
CGROUP_PREFIX = "duvm-bench"
TARGET_RATIO = 1.15
STEAL_WARN_PCT = 5.0  # median CPU steal of a target above which its timings are not trusted


class BenchError(Exception):
    """A target could not be set up or torn down; the message says why."""


@dataclass
class Active:
    """A target while it is set up: the swap device the workload should use."""

    device: str | None  # as /proc/swaps names it; None for no-swap
    frontend: str
    pids: list[int] = field(default_factory=list)


@dataclass
class Run:
    target: str
    rep: int
    frontend: str | None = None
    device: str | None = None
    setup_s: float | None = None
    wall_s: float | None = None
    fill_s: float | None = None  # the workload's own timing of its fill (swap-out) phase
    verify_s: float | None = None  # ... and of its verify (swap-in) phase
    teardown_s: float | None = None
    pswpout: int | None = None  # pages, whole workload (machine-wide counter)
    pswpin: int | None = None
    fill_pswpout: int | None = None
    fill_pswpin: int | None = None
    peak_device_kib: int | None = None  # peak swap use of the device under test
    other_swap_kib: int | None = None  # peak swap use of any other device meanwhile
    steal_pct: float | None = None  # CPU the hypervisor gave to other guests during the run
    intact: bool | None = None
    exit_code: int | None = None
    error: str | None = None
    pids: list[int] = field(default_factory=list)
    cgroup: str | None = None
    leftovers: list[str] = field(default_factory=list)


# --- small helpers ---------------------------------------------------------------------------


def run_tool(tool: str, *args: str, timeout: float = 300) -> str:
    """A util-linux tool by absolute path (attach's convention); BenchError when it fails."""
    path = systools.find_tool(tool)
    if path is None:
        raise BenchError(f"{tool} not found; install {systools.TOOL_PACKAGES.get(tool, tool)}")
    res = subprocess.run(
        [path, *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if res.returncode != 0:
        raise BenchError(f"{tool} {' '.join(args)} failed: {(res.stderr or res.stdout).strip()}")
    return res.stdout


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key in ("pswpout", "pswpin"):
            out[key] = int(value)
    return out


def swaps() -> list[kernel_swap.SwapEntry]:
    return kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


# --- targets ---------------------------------------------------------------------------------


def fuse_frontend(att: attach_state.Attachment) -> str:
    if att.method == attach_state.METHOD_KERNEL:
        return "kernel nbd"
    return f"nbdfuse + loop (direct I/O {'on' if att.direct_io else 'OFF'})"


def detach_or_explain(state_file: Path, keep: Callable[[], None]) -> None:
    """Detach; if swapoff fails the device may hold pages (other programs' too: swap is
    machine-wide), so its server must keep running: `keep` releases it instead of stopping."""
    try:
        attach.detach(state_file, force=True)
    except attach_state.SwapoffFailed as exc:
        keep()
        raise BenchError(
            f"{exc} The server behind it was left running; detach with "
            f"`duvm disable --state-dir {state_file.parent}` once RAM is free."
        ) from exc


@contextlib.contextmanager
def duvm_target(
    memservers: int, args: argparse.Namespace, state: Path, replicas: int = 1
) -> Iterator[Active]:
    # + room for rounding to slabs (as demo)
    capacity = args.size * replicas // memservers + (16 << 20)
    servers = demo.Memservers(memservers, capacity)
    stop = True
    try:
        cfg = control.Config(
            peers=servers.addrs,
            size=args.size,
            replicas=replicas,
            method=args.method,
            state_dir=state,
            priority=PRIORITY,
            daemon_args=trace_args(args, state),
        ).validate()
        att = control.enable(cfg)
        daemon = att.extra.get("daemon_pid")
        pids = [
            *servers.pids,
            *[p for p in (daemon, att.nbdfuse_pid, att.holder_pid) if isinstance(p, int)],
        ]
        try:
            yield Active(att.device, fuse_frontend(att), pids)
        finally:
            try:
                control.disable(state, force=True)
            except attach_state.SwapoffFailed as exc:
                stop = False
                servers.release()
                raise BenchError(f"{exc} The daemon and memservers were left running.") from exc
    finally:
        if stop:
            servers.close()


@contextlib.contextmanager
def socket_server_target(
    argv: list[str], ready: Path, state: Path, what: str, args: argparse.Namespace
) -> Iterator[Active]:
    """An NBD server on a Unix socket (argv), attached by the same `attach.attach` call as
    duvm itself, so it goes through the same frontend. `ready` appears once it listens."""
    log = state / "server.log"
    with open(log, "wb") as out:
        # own session: Ctrl-C must not stop the server while the kernel may still need it
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stop = True
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"{what} did not start: {log.read_text()[-800:].strip()}")
            time.sleep(0.02)
        state_file = state / "state.json"
        att = attach.attach(
            str(state / "server.sock"),
            state_file,
            run_dir=state,
            method=args.method,
            priority=PRIORITY,
        )
        try:
            yield Active(
                att.device,
                fuse_frontend(att),
                [proc.pid, *[p for p in (att.nbdfuse_pid, att.holder_pid) if p]],
            )
        finally:

            def keep() -> None:
                nonlocal stop
                stop = False

            detach_or_explain(state_file, keep)
    finally:
        if stop:
            stop_process(proc)


def nbdkit_target(
    args: argparse.Namespace, state: Path
) -> contextlib.AbstractContextManager[Active]:
    nbdkit = systools.find_tool("nbdkit")
    assert nbdkit is not None  # preflight
    pidfile = state / "nbdkit.pid"  # nbdkit writes it once it listens
    return socket_server_target(
        [
            nbdkit,
            "-f",
            "-U",
            str(state / "server.sock"),
            "-P",
            str(pidfile),
            "memory",
            f"size={args.size}",
        ],
        pidfile,
        state,
        "nbdkit",
        args,
    )


def duvm_local_target(
    args: argparse.Namespace, state: Path
) -> contextlib.AbstractContextManager[Active]:
    sock = state / "server.sock"  # bound and listening once it exists
    return socket_server_target(
        [
            sys.executable,
            "-m",
            "duvm.cli",
            "daemon",
            "--memory",
            "--size",
            str(args.size),
            "--socket",
            str(sock),
            *trace_args(args, state),
        ],
        sock,
        state,
        "duvm daemon --memory",
        args,
    )


def trace_args(args: argparse.Namespace, state: Path) -> list[str]:
    """`--trace` for a duvm daemon when --trace DIR was given: DIR/<target>-<rep>.trace."""
    return ["--trace", str(args.trace / f"{state.name}.trace")] if args.trace else []


@contextlib.contextmanager
def disk_file_target(args: argparse.Namespace, state: Path) -> Iterator[Active]:
    path = args.disk_dir / f"{state.name}.swap"
    active = False
    try:
        # written out, not fallocated: a swap file must have no holes or unwritten extents
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            zeros = bytes(MiB)
            for _ in range(args.size // MiB):
                os.write(fd, zeros)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # not RAM we'd hide swap in
        finally:
            os.close(fd)
        run_tool("mkswap", str(path))
        run_tool("swapon", "-p", str(PRIORITY), str(path))
        active = True
        fs = run_tool("findmnt", "-no", "FSTYPE,SOURCE", "-T", str(args.disk_dir)).split()
        yield Active(str(path), f"kernel swap file ({' on '.join(fs)})")
    finally:
        try:
            if active:
                run_tool("swapoff", str(path), timeout=3600)
        finally:
            if not active or kernel_swap.swap_entry(str(path)) is None:
                path.unlink(missing_ok=True)


ZRAM_CONTROL = Path("/sys/class/zram-control")


def _free_zram() -> tuple[str, bool]:
    """A zram device nobody uses: /dev/zram0 if its disksize is 0, else a hot-added one.
    Returns (name, hot_added)."""
    z0 = Path("/sys/block/zram0/disksize")
    if z0.exists() and int(z0.read_text()) == 0:
        return "zram0", False
    if (ZRAM_CONTROL / "hot_add").exists():
        return f"zram{int((ZRAM_CONTROL / 'hot_add').read_text())}", True
    raise BenchError("/dev/zram0 is in use and this kernel cannot hot-add another zram device")


@contextlib.contextmanager
def zram_target(args: argparse.Namespace, state: Path) -> Iterator[Active]:
    name, hot_added = _free_zram()
    sysdir, dev = Path("/sys/block", name), f"/dev/{name}"
    active = False
    try:
        (sysdir / "disksize").write_text(str(args.size))
        run_tool("mkswap", dev)
        run_tool("swapon", "-p", str(PRIORITY), "--discard=pages", dev)
        active = True
        algo = (sysdir / "comp_algorithm").read_text().split()
        chosen = next((a.strip("[]") for a in algo if a.startswith("[")), "n/a")
        yield Active(dev, f"kernel zram ({chosen}; random data does not compress)")
    finally:
        if active:
            run_tool("swapoff", dev, timeout=3600)  # failing: stays, the error says so
        (sysdir / "reset").write_text("1")
        if hot_added:
            (ZRAM_CONTROL / "hot_remove").write_text(name.removeprefix("zram"))


@contextlib.contextmanager
def no_swap_target(args: argparse.Namespace, state: Path) -> Iterator[Active]:
    yield Active(None, "none (cgroup limited only by RAM)")


TARGET_OPEN: dict[
    str, Callable[[argparse.Namespace, Path], contextlib.AbstractContextManager[Active]]
] = {
    "duvm-1": lambda a, s: duvm_target(1, a, s),
    "duvm-3": lambda a, s: duvm_target(3, a, s),
    "duvm-3r2": lambda a, s: duvm_target(3, a, s, replicas=2),
    "nbdkit": nbdkit_target,
    "duvm-local": duvm_local_target,
    "disk-file": disk_file_target,
    "zram": zram_target,
    "no-swap": no_swap_target,
}


# --- one run ---------------------------------------------------------------------------------


class SwapPeak(threading.Thread):
    """Polls /proc/swaps: peak use of `device`, and of every other device together."""

    def __init__(self, device: str | None, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.real = os.path.realpath(device) if device else None
        self.interval = interval
        self.device_kib: int | None = 0 if device else None
        self.other_kib = 0
        self.stop = threading.Event()

    def sample(self) -> None:
        mine, other = 0, 0
        for e in swaps():
            if self.real and e.filename == self.real:
                mine = e.used_kb
            else:
                other += e.used_kb
        if self.device_kib is not None:
            self.device_kib = max(self.device_kib, mine)
        self.other_kib = max(self.other_kib, other)

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()


def run_workload(run: Run, args: argparse.Namespace, limit_bytes: int, device: str | None) -> None:
    peak = SwapPeak(device)
    peak.sample()
    peak.start()
    before, mid = vmstat(), None
    cpu_before = cpu_times()
    tail: list[str] = []
    try:
        with cgroup.MemoryCgroup(limit_bytes, prefix=CGROUP_PREFIX) as cg:
            run.cgroup = str(cg.path)
            t0 = time.monotonic()
            proc = cg.popen(
                [sys.executable, "-m", "duvm.cli.workload", "--mib", str(args.mib), "--progress"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            killer = threading.Timer(args.timeout, proc.kill)
            killer.start()
            try:
                assert proc.stderr is not None and proc.stdout is not None
                for line in proc.stderr:
                    parts = line.split()
                    if (
                        parts[:2] == ["progress", "fill"]
                        and len(parts) == 4
                        and parts[2] == parts[3]
                        and mid is None
                    ):
                        mid = vmstat()  # the fill phase just ended
                    elif parts[:1] != ["progress"]:
                        tail = [*tail[-5:], line.rstrip()]
                stdout = proc.stdout.read()
                run.exit_code = proc.wait()
                run.wall_s = round(time.monotonic() - t0, 3)
            finally:
                killer.cancel()
                for stream in (proc.stdout, proc.stderr):
                    if stream:
                        stream.close()
    finally:
        peak.stop.set()
        peak.join(5)
    after = vmstat()
    run.steal_pct = steal_percent(cpu_before, cpu_times())
    peak.sample()
    run.peak_device_kib, run.other_swap_kib = peak.device_kib, peak.other_kib
    run.pswpout = after["pswpout"] - before["pswpout"]
    run.pswpin = after["pswpin"] - before["pswpin"]
    if mid is not None:
        run.fill_pswpout = mid["pswpout"] - before["pswpout"]
        run.fill_pswpin = mid["pswpin"] - before["pswpin"]
    lines = stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if result is not None:
        run.fill_s, run.verify_s = result.get("fill_s"), result.get("verify_s")
    run.intact = run.exit_code == 0 and bool(result and result.get("intact"))
    if not run.intact:
        why = (
            "killed after --timeout"
            if run.exit_code == -signal.SIGKILL
            else f"exit {run.exit_code}"
        )
        run.error = f"workload failed ({why}): {' | '.join(tail) or 'no message'}"


def leftovers(state: Path, run: Run) -> list[str]:
    """What of this run is still there (empty: a clean teardown)."""
    left = []
    for bf in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            if bf.read_text().startswith(f"{state}/"):
                left.append(f"loop device /dev/{bf.parent.parent.name}")
    left += [f"mount {m}" for m in mounts_below(state)]
    if run.device and kernel_swap.swap_entry(run.device) is not None:
        left.append(f"swap {run.device}")
    if run.cgroup and Path(run.cgroup).exists():
        left.append(f"cgroup {run.cgroup}")
    left += [f"process {p}" for p in run.pids if processes.pid_alive(p)]
    return left


def run_target(
    name: str, rep: int, args: argparse.Namespace, workdir: Path, runs: list[Run]
) -> None:
    """Set up target `name`, run the workload on it, tear it down; the run goes into `runs`
    first, so an interrupted one is recorded too (with what it left behind)."""
    run = Run(name, rep)
    runs.append(run)
    state = workdir / f"{name}-{rep}"
    state.mkdir()
    limit = mem_total_bytes() if name == "no-swap" else args.limit_mib * MiB
    t0 = teardown_from = time.monotonic()
    try:
        with TARGET_OPEN[name](args, state) as active:
            run.frontend, run.device, run.pids = active.frontend, active.device, active.pids
            run.setup_s = round(time.monotonic() - t0, 3)
            rivals = [
                e.filename
                for e in swaps()
                if e.priority >= PRIORITY
                and e.filename != (active.device and os.path.realpath(active.device))
            ]
            if rivals:
                raise BenchError(
                    f"swap {', '.join(rivals)} appeared at priority {PRIORITY}: "
                    "the workload's pages would be shared with it"
                )
            run_workload(run, args, limit, active.device)
            teardown_from = time.monotonic()
        run.teardown_s = round(time.monotonic() - teardown_from, 3)
    except (
        BenchError,
        attach_state.AttachError,
        control.ControlError,
        cgroup.CgroupError,
        OSError,
        subprocess.SubprocessError,
        ValueError,
    ) as exc:
        run.error = f"{run.error + '; ' if run.error else ''}{type(exc).__name__}: {exc}"
    except KeyboardInterrupt:
        run.error = "interrupted"
        raise
    finally:
        run.leftovers = leftovers(state, run)
        if not run.leftovers:  # never rmtree into a mount that is still there
            shutil.rmtree(state, ignore_errors=True)
    say(
        f"  {name:<9} rep {rep + 1}: wall {fmt(run.wall_s)} s (fill {fmt(run.fill_s)}, verify "
        f"{fmt(run.verify_s)}), out {mib(run.pswpout)} MiB, in {mib(run.pswpin)} MiB, "
        f"steal {fmt(run.steal_pct, 1)}%, "
        f"{'intact' if run.intact else 'NOT intact' if run.intact is False else 'not run'}"
        + (f"  ERROR: {run.error}" if run.error else "")
        + (f"  LEFT BEHIND: {', '.join(run.leftovers)}" if run.leftovers else "")
    )


def mounts_below(path: Path) -> list[str]:
    return [
        m
        for m in (line.split()[1] for line in Path("/proc/mounts").read_text().splitlines())
        if m.startswith(f"{path}/")
    ]


def mem_total_bytes() -> int:
    return kernel_swap.mem_total_kb() * 1024


# --- preflight, machine info, summary --------------------------------------------------------


def preflight(args: argparse.Namespace) -> list[str]:
    """Why the benchmark cannot run as asked (empty: it can)."""
    problems = demo.preflight()  # root, swap tools, a way to attach, a memory cgroup
    if "nbdkit" in args.targets and systools.find_tool("nbdkit") is None:
        problems.append("nbdkit missing: install nbdkit (or leave out --targets nbdkit)")
    if (
        "zram" in args.targets
        and not Path("/sys/block/zram0").exists()
        and not (ZRAM_CONTROL / "hot_add").exists()
    ):
        problems.append("no zram device (modprobe zram, or leave out --targets zram)")
    if "disk-file" in args.targets:
        res = subprocess.run(
            ["findmnt", "-no", "FSTYPE", "-T", str(args.disk_dir)],
            capture_output=True,
            text=True,
            check=False,
        )
        fs = res.stdout.strip()
        if fs not in SWAP_FILE_FS:
            problems.append(
                f"--disk-dir {args.disk_dir} is on {fs or 'an unknown filesystem'}; "
                f"a plain swap file needs one of {', '.join(SWAP_FILE_FS)}"
            )
    rivals = demo.competing_swaps()
    if rivals:
        problems.append(
            f"swap {', '.join(rivals)} is already active at priority {PRIORITY}: "
            "the workload's pages would be shared between it and each target; "
            "swapoff it first"
        )
    if args.mib <= args.limit_mib or args.limit_mib < 16:
        problems.append("--mib must exceed --limit-mib (>= 16) so the workload swaps")
    if args.size < args.mib * MiB:
        problems.append("--size must hold the whole workload")
    if args.reps < 1:
        problems.append("--reps must be at least 1")
    if args.trace and not args.trace.is_dir():
        problems.append(f"--trace {args.trace}: not a directory (create it first)")
    return problems


def machine(args: argparse.Namespace) -> dict[str, Any]:
    def cmd(*a: str) -> str:
        try:
            out = subprocess.run(a, capture_output=True, text=True, timeout=10, check=False)
        except OSError:
            return "n/a"
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "n/a"

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
        "n/a",
    )
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "mem_mib": mem_total_bytes() // MiB,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nbdkit": cmd("nbdkit", "--version"),
        "nbdfuse": cmd("nbdfuse", "--version"),
        "attach_method": args.method,
        "cgroup": f"v{cgroup.detect_version()}",
        "swappiness": Path("/proc/sys/vm/swappiness").read_text().strip(),
        "other_swaps": [asdict(e) for e in swaps()],
        "loadavg_start": os.getloadavg(),
    }


def fmt(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def mib(pages: float | None) -> str:
    return "n/a" if pages is None else f"{pages * PAGE / MiB:.0f}"


def loads(v: tuple[float, ...] | list[float]) -> str:
    return " ".join(f"{x:.2f}" for x in v)


def say(text: str) -> None:
    print(text, flush=True)


def med(runs: list[Run], key: str) -> float | None:
    vals = [getattr(r, key) for r in runs if getattr(r, key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[Run], targets: list[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for t in targets:
        ok = [r for r in runs if r.target == t and r.intact and not r.error]
        out[t] = {
            "runs": len([r for r in runs if r.target == t]),
            "ok": len(ok),
            "frontend": next((r.frontend for r in ok), None),
            **{
                k: med(ok, k)
                for k in (
                    "wall_s",
                    "fill_s",
                    "verify_s",
                    "setup_s",
                    "teardown_s",
                    "pswpout",
                    "pswpin",
                    "fill_pswpout",
                    "peak_device_kib",
                    "steal_pct",
                )
            },
            # the spread says how much to trust the median on a busy machine
            "wall_s_min": min((r.wall_s for r in ok if r.wall_s is not None), default=None),
            "wall_s_max": max((r.wall_s for r in ok if r.wall_s is not None), default=None),
        }
    base = out.get("nbdkit", {})
    floor = out.get("no-swap", {}).get("wall_s")
    for s in out.values():
        for k in ("wall_s", "fill_s", "verify_s"):
            s[f"{k}_vs_nbdkit"] = (
                round(s[k] / base[k], 3) if s.get(k) is not None and base.get(k) else None
            )
        # what swapping added to the workload's own CPU time (no-swap's wall)
        s["over_floor_s"] = (
            round(s["wall_s"] - floor, 3) if s["wall_s"] is not None and floor is not None else None
        )
    return out


def markdown(
    summary: dict[str, dict[str, Any]], info: dict[str, Any], args: argparse.Namespace
) -> str:
    lines = [
        f"Machine: {info['cpu']}, {info['cpus']} CPUs, {info['mem_mib']} MiB RAM, kernel "
        f"{info['kernel']}, Python {info['python']}, {info['nbdkit']}, {info['nbdfuse']}, "
        f"cgroup {info['cgroup']}, swappiness {info['swappiness']}. Load average at start "
        f"{loads(info['loadavg_start'])}, at end {loads(info['loadavg_end'])}.",
        f"Workload: {args.mib} MiB of random data in a cgroup limited to {args.limit_mib} MiB, "
        f"every byte verified; swap devices {args.size // MiB} MiB at priority {PRIORITY}. "
        f"Median of {args.reps} interleaved runs per target; fill is mostly swap-out, verify "
        "mostly swap-in (the workload's own timings); over no-swap = wall minus the no-swap "
        "wall (what swapping added); out/in = pswpout/pswpin from /proc/vmstat (machine-wide; "
        "pages can move more than once).",
        "",
        "| target | frontend | wall s | wall min-max | vs nbdkit | over no-swap s | fill s "
        "| verify s | out MiB | in MiB | peak on device MiB | CPU steal % | ok runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, s in summary.items():
        ratio = "n/a" if s["wall_s_vs_nbdkit"] is None else f"{s['wall_s_vs_nbdkit']:.2f}x"
        peak = "n/a" if s["peak_device_kib"] is None else f"{s['peak_device_kib'] / 1024:.0f}"
        lines.append(
            f"| {t} | {s['frontend'] or 'n/a'} | {fmt(s['wall_s'])} | "
            f"{fmt(s['wall_s_min'])}-{fmt(s['wall_s_max'])} | {ratio} | "
            f"{fmt(s['over_floor_s'])} | {fmt(s['fill_s'])} | {fmt(s['verify_s'])} | "
            f"{mib(s['pswpout'])} | {mib(s['pswpin'])} | {peak} | "
            f"{fmt(s['steal_pct'], 1)} | {s['ok']}/{s['runs']} |"
        )
    return "\n".join(lines)


def verdict(summary: dict[str, dict[str, Any]]) -> str | None:
    r = summary.get("duvm-3", {}).get("wall_s_vs_nbdkit")
    if r is None:
        return None
    met = "met" if r <= TARGET_RATIO else "NOT met"
    line = f"target duvm-3 within {TARGET_RATIO}x of nbdkit: {met} ({r:.2f}x)"
    steal = max(
        (s["steal_pct"] for s in summary.values() if s.get("steal_pct") is not None), default=None
    )
    if steal is not None and steal >= STEAL_WARN_PCT:
        line += (
            f"; but the hypervisor took up to {steal:.0f}% of the CPUs (steal) during "
            "the runs, so the timings measure the host's load too: run again when quiet"
        )
    return line


# --- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench_swap.py",
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("Theory of operation")[1].split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--targets",
        default=",".join(TARGETS),
        help=f"comma-separated, in this order per round (default: {','.join(TARGETS)})",
    )
    ap.add_argument("--reps", type=int, default=3, help="runs per target, median (default 3)")
    ap.add_argument("--mib", type=int, default=256, help="workload size in MiB (default 256)")
    ap.add_argument(
        "--limit-mib",
        type=int,
        default=64,
        help="RAM limit of the workload's cgroup in MiB (default 64)",
    )
    ap.add_argument(
        "--size",
        type=parse_size,
        default=None,
        help="size of each swap device (default 1.5x the workload)",
    )
    ap.add_argument(
        "--method",
        choices=("auto", attach_state.METHOD_KERNEL, attach_state.METHOD_FUSE),
        default="auto",
        help="frontend for duvm and nbdkit alike (auto: kernel nbd "
        "when the kernel has it, else nbdfuse + loop)",
    )
    ap.add_argument(
        "--disk-dir",
        type=Path,
        default=Path("/var/tmp"),
        help="where the disk-file target's swap file goes (default /var/tmp)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds before a workload run is killed (default 600)",
    )
    ap.add_argument("--json", type=Path, metavar="FILE", help="write every run and the medians")
    ap.add_argument(
        "--trace",
        type=Path,
        metavar="DIR",
        help="duvm daemons write a request trace per run to DIR/TARGET-REP.trace "
        "(summarise with benchmarks/nbd_trace.py; costs about 1.5 us per request)",
    )
    ap.add_argument("--markdown", type=Path, metavar="FILE", help="write the table")
    args = ap.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown or not args.targets:
        ap.error(
            f"unknown target(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(TARGETS)}"
        )
    args.size = args.size or (args.mib + args.mib // 2) * MiB
    args.size -= args.size % MiB
    return args


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problems = preflight(args)
    if problems:
        print("bench_swap cannot run here:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _raise_on_signal)  # `timeout`, kill: clean up like Ctrl-C
    if args.method == "auto":
        args.method = (
            attach_state.METHOD_KERNEL if attach_kernel.available() else attach_state.METHOD_FUSE
        )
    info = machine(args)
    say(
        f"bench_swap: {info['cpu']}, {info['cpus']} CPUs, {info['mem_mib']} MiB, kernel "
        f"{info['kernel']}, load average {loads(info['loadavg_start'])}; frontend for duvm and "
        f"nbdkit: {args.method}"
    )
    others = [f"{e['filename']} (priority {e['priority']})" for e in info["other_swaps"]]
    if others:
        say(
            f"  other swap devices (lower priority, unused while a target has room): "
            f"{', '.join(others)}"
        )
    say(
        f"  workload {args.mib} MiB in a {args.limit_mib} MiB cgroup, devices "
        f"{args.size // MiB} MiB, {args.reps} interleaved rep(s) of {', '.join(args.targets)}"
    )
    workdir = Path(tempfile.mkdtemp(prefix="duvm-bench-", dir="/run"))
    runs: list[Run] = []
    interrupted = False
    try:
        for rep in range(args.reps):
            k = rep % len(args.targets)
            for name in args.targets[k:] + args.targets[:k]:  # rotate: no target always first
                run_target(name, rep, args, workdir, runs)
    except KeyboardInterrupt:
        interrupted = True
        left = runs[-1].leftovers if runs else []
        say(
            "interrupted; "
            + (
                f"LEFT BEHIND: {', '.join(left)}"
                if left
                else "the target in progress was torn down"
            )
        )
    finally:
        if not mounts_below(workdir):
            shutil.rmtree(workdir, ignore_errors=True)
    info["loadavg_end"] = os.getloadavg()
    summary = summarize(runs, args.targets)
    table = markdown(summary, info, args)
    say("\n" + table)
    if v := verdict(summary):
        say(v)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": info,
                    "targets": args.targets,
                    "reps": args.reps,
                    "mib": args.mib,
                    "limit_mib": args.limit_mib,
                    "size_bytes": args.size,
                    "priority": PRIORITY,
                    "interrupted": interrupted,
                    "runs": [asdict(r) for r in runs],
                    "median": summary,
                    "verdict": verdict(summary),
                },
                indent=2,
            )
            + "\n"
        )
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if interrupted:
        return 130
    failed = any(r.error or not r.intact or r.leftovers for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
