"""Boot the duvm test guest under QEMU and collect what it reports (host side).

Theory of operation
-------------------
1. :func:`build_initramfs.ensure_kernel` provides Debian 12's kernel (which has nbd) from a
   fixed cache directory, downloading it with apt the first time.
2. Memservers (``duvm memserver``) start on the host, on 127.0.0.1 with a port the kernel
   picks; QEMU's user-mode network (slirp) makes the host's loopback reachable from the guest as
   10.0.2.2, so nothing listens beyond loopback and the guest needs no bridge or tap device.
3. QEMU boots the kernel with a per-run initramfs (``init.sh`` + busybox + modules), TCG on
   one vCPU (two ran 4.5x slower here; KVM is not assumed), the host's / shared read-only over
   9p so the guest runs the host's Python and the working tree's ``duvm`` code. The guest runs
   ``guest_check.py``, which reports on the second serial port (a file here); the console
   (first serial port) is kept for diagnostics.
4. Everything started here dies with us: QEMU and the memservers get PR_SET_PDEATHSIG, a hard
   deadline kills QEMU's process group, and ``finally`` stops the memservers after asking them
   (over the page protocol) how many pages they still hold.

:func:`run_guest` returns a :class:`GuestRun`; the pytest test asserts on it, and ``python
tools/qemu_guest/boot.py`` prints it with timings for a manual run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_initramfs  # sibling module; tools/ is not a package

HERE = Path(__file__).resolve().parent
GUEST_SCRIPT = HERE / "guest_check.py"
QEMU = "qemu-system-x86_64"
RESULT_PREFIX = "DUVM-RESULT "
HOST_FROM_GUEST = "10.0.2.2"  # slirp's alias for the host's loopback
_PR_SET_PDEATHSIG = 1


class GuestUnavailable(Exception):
    """Something this host lacks to boot the guest (a SKIP reason for tests)."""


@dataclass
class GuestRun:
    rc: int | None  # QEMU's exit status; None when we killed it
    timed_out: bool
    seconds: float  # QEMU start to exit
    events: dict[str, dict[str, Any]]  # guest event name -> its report
    markers: list[str]  # the init script's own lines on the result port
    console: str
    memservers_after: list[dict[str, Any] | None] = field(default_factory=list)
    hung: bool = False  # the watchdog saw no page move and no guest progress for stall_s
    memserver_killed_at: float | None = None  # seconds after QEMU started (kill_memserver_at)
    memserver_stopped_at: float | None = None  # seconds after QEMU started (stop_memserver_at)

    @property
    def guest_exit(self) -> int | None:
        """The guest script's exit code as init reported it (None: it never said)."""
        for m in self.markers:
            if m.startswith("DUVM-GUEST-END "):
                with contextlib.suppress(ValueError):
                    return int(m.split()[1])
        return None

    def console_tail(self, n: int = 4000) -> str:
        return self.console[-n:]


def _die_with_parent() -> None:
    """preexec_fn: the kernel SIGKILLs the child if the test process dies first."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def problems() -> list[str]:
    """Why the guest cannot boot here (empty: it can, apart from fetching the kernel)."""
    out = []
    if os.geteuid() != 0:
        out.append("needs root (reading the kernel cache, the guest attaches as root over 9p)")
    if shutil.which(QEMU) is None:
        out.append(f"{QEMU} not found (Debian package qemu-system-x86)")
    if not build_initramfs.BUSYBOX.exists():
        out.append("busybox not found (Debian package busybox-static)")
    elif not build_initramfs.is_static_elf(build_initramfs.BUSYBOX.read_bytes()):
        out.append("busybox is dynamically linked (install busybox-static)")
    return out


# --- memservers -----------------------------------------------------------------------------


@dataclass
class Memserver:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path


def start_memserver(
    python: str,
    capacity: str,
    workdir: Path,
    index: int,
    timeout: float = 60,
    net: TapNet | None = None,
    secret_file: Path | None = None,
) -> Memserver:
    log = workdir / f"memserver{index}.log"
    host = net.host_ip if net is not None else "127.0.0.1"
    prefix = net.exec_prefix() if net is not None else []
    auth = ["--secret-file", str(secret_file)] if secret_file is not None else ["--insecure"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                *prefix,
                python,
                "-m",
                "duvm.cli",
                "memserver",
                "--listen",
                f"{host}:0",
                "--capacity",
                capacity,
                "-v",  # each connection's start and end in the run's log
                *auth,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(rf"listening on {re.escape(host)}:(\d+)", log.read_text(errors="replace"))
        if m:
            return Memserver(proc, int(m.group(1)), log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    stop_memserver(Memserver(proc, 0, log))
    raise RuntimeError(f"memserver did not start: {log.read_text(errors='replace')[-800:]}")


def start_nbdkit(size: str, workdir: Path, timeout: float = 60) -> Memserver:
    """`nbdkit memory` on 127.0.0.1, the baseline's stand-in for the memservers (an NBD server
    in C holding the pages in this host's RAM)."""
    import socket

    with socket.socket() as probe:  # a free port (nbdkit cannot report one it picked)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = workdir / "nbdkit.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "memory", f"size={size}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as c:
            if c.connect_ex(("127.0.0.1", port)) == 0:
                return Memserver(proc, port, log)
        time.sleep(0.05)
    stop_memserver(Memserver(proc, port, log))
    raise RuntimeError(f"nbdkit did not start: {log.read_text(errors='replace')[-800:]}")


def stop_memserver(ms: Memserver) -> None:
    if ms.proc.poll() is None:
        ms.proc.send_signal(signal.SIGTERM)
        try:
            ms.proc.wait(15)
        except subprocess.TimeoutExpired:
            ms.proc.kill()
            ms.proc.wait(15)


def memserver_status(
    port: int,
    net: TapNet | None = None,
    python: str = sys.executable,
    secret_file: Path | None = None,
) -> dict[str, Any] | None:
    """A memserver's STATUS; through the namespace's own stack when it lives in one."""
    if net is not None:
        code = (
            "import asyncio, json, sys\nfrom duvm.store.memserver_status import query_status\n"
            f"print(json.dumps(asyncio.run(query_status({net.host_ip!r}, {port}, "
            "timeout=5))))"
        )
        try:
            res = subprocess.run(
                [*net.exec_prefix(), python, "-c", code],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            return json.loads(res.stdout) if res.returncode == 0 else None
        except (subprocess.TimeoutExpired, ValueError):
            return None
    from duvm.store.memserver_status import query_status
    from duvm.wire import auth

    security = None
    if secret_file is not None:  # a memserver that requires the cluster secret
        security = auth.PeerSecurity(auth.Keyring.from_file(secret_file))
    try:
        return asyncio.run(query_status("127.0.0.1", port, timeout=5, security=security))
    except Exception:  # unknown is None, never a made-up 0
        return None


# --- tap networking in a private network namespace ------------------------------------------


@dataclass
class TapNet:
    """A network namespace of our own holding a tap device: QEMU and the host-side memservers
    run inside it, the guest's NIC is the tap, so the page path is the kernel's TCP stack on
    both ends instead of QEMU's user-mode network (slirp). Nothing outside the namespace is
    touched; `close` deletes it with everything in it."""

    name: str
    host_ip: str = "10.0.3.1"
    guest_ip: str = "10.0.3.2"
    tap: str = "duvmtap0"

    @classmethod
    def create(cls) -> TapNet:
        ip = shutil.which("ip") or "/usr/sbin/ip"
        net = cls(f"duvm-qemu-{os.getpid()}-{os.urandom(3).hex()}")
        steps = [
            [ip, "netns", "add", net.name],
            [ip, "-n", net.name, "link", "set", "lo", "up"],
            [ip, "-n", net.name, "tuntap", "add", "dev", net.tap, "mode", "tap"],
            [ip, "-n", net.name, "addr", "add", f"{net.host_ip}/24", "dev", net.tap],
            [ip, "-n", net.name, "link", "set", net.tap, "up"],
        ]
        for cmd in steps:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
            if res.returncode != 0:
                net.close()
                raise GuestUnavailable(
                    f"cannot set up tap networking ({' '.join(cmd)}): {res.stderr.strip()}"
                )
        return net

    def exec_prefix(self) -> list[str]:
        return [shutil.which("ip") or "/usr/sbin/ip", "netns", "exec", self.name]

    def close(self) -> None:
        subprocess.run(
            [shutil.which("ip") or "/usr/sbin/ip", "netns", "del", self.name],
            capture_output=True,
            timeout=30,
            check=False,
        )


# --- QEMU -----------------------------------------------------------------------------------


def qemu_command(
    kernel: build_initramfs.GuestKernel,
    initrd: Path,
    mem_mib: int,
    console: Path,
    results: Path,
    net: TapNet | None = None,
    monitor: Path | None = None,
    cpus: int = 1,
) -> list[str]:
    netdev = (
        f"tap,id=n0,ifname={net.tap},script=no,downscript=no" if net is not None else "user,id=n0"
    )
    return [
        *(net.exec_prefix() if net is not None else []),
        QEMU,
        "-M",
        "pc",
        "-accel",
        "tcg",
        "-smp",
        str(cpus),
        "-m",
        str(mem_mib),
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        str(kernel.vmlinuz),
        "-initrd",
        str(initrd),
        "-append",
        "console=ttyS0 panic=-1 loglevel=4",
        "-serial",
        f"file:{console}",
        "-serial",
        f"file:{results}",
        # the host's / read-only: the guest runs this very checkout with the host's Python
        "-virtfs",
        "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
        "-netdev",
        netdev,
        "-device",
        "virtio-net-pci,netdev=n0",
        *(["-monitor", f"unix:{monitor},server=on,wait=off"] if monitor is not None else []),
    ]


def parse_results(text: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The guest's result port -> (events by name, init's marker lines). Garbage is skipped."""
    events: dict[str, dict[str, Any]] = {}
    markers: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(RESULT_PREFIX):
            try:
                ev = json.loads(line[len(RESULT_PREFIX) :])
            except ValueError:
                continue
            if isinstance(ev, dict) and isinstance(ev.get("event"), str):
                events[ev["event"]] = ev
        elif line.startswith("DUVM-GUEST-"):
            markers.append(line)
    return events, markers


def run_guest(
    *,
    python: str = sys.executable,
    workload_mib: int = 48,
    cgroup_mib: int | None = 24,
    swap_size: str = "128M",
    mem_mib: int = 384,
    memservers: int = 1,
    capacity: str = "128M",
    host_memservers: bool = False,
    timeout_s: float = 420,
    workdir: Path | None = None,
    kill_at_pct: int | None = None,
    network: str = "user",
    sysrq_at: list[float] | None = None,
    daemon_args: str = "",
    order: str = "sequential",
    chunk_kib: int = 1024,
    passes: int = 1,
    runs: int = 1,
    baseline_nbdkit: bool = False,
    swap_no_discard: bool = False,
    stall_s: float | None = None,
    kill_memserver_at: int | None = None,
    stop_memserver_at: int | None = None,
    stop_memserver_s: float = 20.0,
    reproduction: bool = False,
    sysctl: str = "",
    method: str = "kernel-nbd",
    cache: Path = build_initramfs.DEFAULT_CACHE,
    guest_env: dict[str, str] | None = None,
    cpus: int = 1,
    workers: int = 1,
) -> GuestRun:
    """Boot the guest once; always cleans up what it started.

    The guest starts `memservers` memservers of `capacity` each inside itself, on its loopback
    (the default), or with `host_memservers` they run here and the guest reaches them through
    QEMU's user network (known to stall, see docs/KERNEL_NBD_QEMU.md). The workload holds
    `workload_mib` MiB, in a memory cgroup of `cgroup_mib` MiB (None: no cgroup, it outgrows the
    guest's RAM). With `kill_at_pct` the guest SIGKILLs the daemon when the workload's fill
    reaches that percentage (the workload stopped until the supervisor has resumed it) and
    then runs `duvm enable --resume` by hand, which must find nothing to do. The workload
    touches its chunks of `chunk_kib` in `order` and verifies `passes` times, `runs` times
    over against the same daemon (a long-lived one). With `baseline_nbdkit` nbdkit stands in
    for duvm: `nbdkit memory` here, `nbdkit nbd` in the guest relaying to it, attached as duvm
    attaches. `swap_no_discard` swaps on again without discard after `duvm enable` (an
    experiment). With `stall_s` a watchdog ends the run as hung (after SysRq w and m for the
    console) once the workload has started and neither the guest's swap counters nor its
    progress lines moved for that long.
    With `kill_memserver_at` (25, 50 or 75) the last host memserver is SIGKILLed when the
    workload's fill reaches that percentage; with `stop_memserver_at` it is SIGSTOPped then
    instead, and continued `stop_memserver_s` later (a memserver that stops answering without
    losing its connections: the last-replica wait, D36). With `reproduction` (host memservers)
    the guest types exactly `duvm enable --peers ... --size ... --secret-file F` with a cluster
    secret made here, and the workload is a plain `python3 -c` holding os.urandom blocks,
    verified twice by SHA-256. `sysctl` ("kernel.sched_rt_runtime_us=-1 ...") is set in the
    guest at boot. `method` is how the guest's duvm attaches (`kernel-nbd`, or `nbdfuse-loop`:
    the fallback for kernels without nbd). `cpus`: the guest's vCPUs; `workers`: `duvm enable
    --workers N` (one kernel nbd connection per daemon worker, D49; the driver maps each vCPU
    to one of them, so they see requests only with as many vCPUs). `guest_env`
    adds settings for the guest script
    (experiments: `DUVM_NBD_IO_TIMEOUT_MS`, `DUVM_KILL_STOP_WORKLOAD`). `python` must import
    duvm (the project's venv); the guest uses the same path. Raises GuestUnavailable when this
    host cannot boot it.
    """
    if why := problems():
        raise GuestUnavailable("; ".join(why))
    try:
        kernel = build_initramfs.ensure_kernel(cache)
    except build_initramfs.KernelUnavailable as exc:
        raise GuestUnavailable(str(exc)) from exc
    own_tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="duvm-qemu-")) if workdir is None else workdir
    servers: list[Memserver] = []
    qemu: subprocess.Popen[bytes] | None = None
    net: TapNet | None = None
    try:
        if network == "tap":
            net = TapNet.create()
        elif network != "user":
            raise ValueError(f"network must be 'user' or 'tap', not {network!r}")
        secret: Path | None = None
        if reproduction:
            secret = cluster_secret(python, work)
        if baseline_nbdkit:
            servers.append(start_nbdkit(swap_size, work))
        elif host_memservers:
            for i in range(memservers):
                servers.append(
                    start_memserver(python, capacity, work, i, net=net, secret_file=secret)
                )
        host = net.host_ip if net is not None else HOST_FROM_GUEST
        peers = "" if baseline_nbdkit else ",".join(f"{host}:{s.port}" for s in servers)
        env = {
            "DUVM_PYTHON": python,
            "DUVM_SCRIPT": str(GUEST_SCRIPT),
            "DUVM_PEERS": peers,
            "DUVM_SIZE": swap_size,
            "DUVM_MIB": str(workload_mib),
            "DUVM_HUNG_TASK_S": "30",
            "DUVM_LOCAL_MEMSERVERS": str(memservers),
            "DUVM_CAPACITY": capacity,
            "DUVM_CGROUP_MIB": "" if cgroup_mib is None else str(cgroup_mib),
            "DUVM_KILL_AT_PCT": "" if kill_at_pct is None else str(kill_at_pct),
            "DUVM_CONSOLE_LOGLEVEL": "7" if sysrq_at else "",
            "DUVM_DAEMON_ARGS": daemon_args,
            "DUVM_ORDER": order,
            "DUVM_SECRET_FILE": str(secret) if secret else "",
            "DUVM_URANDOM_WORKLOAD": "1" if reproduction else "",
            "DUVM_SYSCTL": sysctl,
            "DUVM_METHOD": method,
            "DUVM_CHUNK_KIB": str(chunk_kib),
            "DUVM_PASSES": str(passes),
            "DUVM_RUNS": str(runs),
            "DUVM_SWAP_NO_DISCARD": "1" if swap_no_discard else "",
            "DUVM_NBDKIT_ADDR": f"{host}:{servers[0].port}" if baseline_nbdkit else "",
            "DUVM_GUEST_IP": net.guest_ip if net is not None else "10.0.2.15",
            "DUVM_GATEWAY": net.host_ip if net is not None else HOST_FROM_GUEST,
            "DUVM_WORKERS": str(workers),
            **(guest_env or {}),
        }
        initrd = build_initramfs.build_initramfs(kernel, env, work / "initramfs.cpio")
        console, results = work / "console.log", work / "results.log"
        monitor = work / "monitor.sock" if sysrq_at or stall_s else None
        cmd = qemu_command(kernel, initrd, mem_mib, console, results, net, monitor, cpus)
        t0 = time.monotonic()
        qemu = start_qemu(cmd, work / "qemu.log")
        if kill_memserver_at is not None and stop_memserver_at is not None:
            raise ValueError("kill_memserver_at and stop_memserver_at exclude each other")
        act_at = kill_memserver_at if kill_memserver_at is not None else stop_memserver_at
        watch = Watchdog(console, stall_s, act_at)
        sysrq_due = sorted(sysrq_at or [])
        killed_at: float | None = None
        stopped_at: float | None = None
        continue_at: float | None = None
        tcp_log = HostTcpLog(work / "host_tcp.log", [s.port for s in servers], net)
        while qemu.poll() is None and time.monotonic() < t0 + timeout_s:
            time.sleep(1.0)
            now = time.monotonic()
            tcp_log.poll(now - t0)
            if sysrq_due and now >= t0 + sysrq_due[0]:  # diagnostics, see --sysrq-at
                sysrq_due.pop(0)
                assert monitor is not None
                sysrq(monitor, "wmt")
            watch.poll(now)
            if watch.kill_due and kill_memserver_at is not None and killed_at is None and servers:
                servers[-1].proc.kill()  # a memserver lost mid-run: its pages with it
                killed_at = round(now - t0, 1)
            if watch.kill_due and stop_memserver_at is not None and stopped_at is None and servers:
                servers[-1].proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
                stopped_at, continue_at = round(now - t0, 1), now + stop_memserver_s
            if continue_at is not None and now >= continue_at:
                servers[-1].proc.send_signal(signal.SIGCONT)
                continue_at = None
            if watch.hung:
                assert monitor is not None
                sysrq(monitor, HUNG_SYSRQ)  # the stacks and memory on the console, then stop
                time.sleep(HUNG_SYSRQ_FLUSH_S)
                break
        rc = qemu.poll()
        timed_out = rc is None and not watch.hung
        seconds = round(time.monotonic() - t0, 1)
        kill_group(qemu)
        events, markers = parse_results(read_text(results))
        return GuestRun(
            rc,
            timed_out,
            seconds,
            events,
            markers,
            read_text(console) + read_text(work / "qemu.log"),
            [memserver_status(s.port, net, python, secret) for s in servers],
            hung=watch.hung,
            memserver_killed_at=killed_at,
            memserver_stopped_at=stopped_at,
        )
    finally:
        if qemu is not None:
            kill_group(qemu)
        for s in servers:
            with contextlib.suppress(OSError):
                s.proc.send_signal(signal.SIGCONT)  # a stopped one would not hear SIGTERM
            stop_memserver(s)
        if net is not None:
            net.close()
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


class HostTcpLog:
    """Every few seconds, the host's side of the memservers' TCP connections (`ss -tin`: the
    memserver's end and QEMU's user network's end, queues, retransmits, windows) appended to
    `path`; when a guest's connections stall, this says which side stopped."""

    EVERY_S = 5.0

    def __init__(self, path: Path, ports: list[int], net: TapNet | None) -> None:
        self.path = path
        self.ports = ports
        self.prefix = net.exec_prefix() if net is not None else []
        self.ss = shutil.which("ss")  # iproute2; without it nothing is logged
        match = " or ".join(f"sport = :{p} or dport = :{p}" for p in ports)
        self.filter = f"( {match} )"
        self._next = 0.0

    def poll(self, t: float) -> None:
        if not self.ports or self.ss is None or t < self._next:
            return
        self._next = t + self.EVERY_S
        try:
            out = subprocess.run(
                [*self.prefix, self.ss, "-tinoa", self.filter],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            out = f"ss failed: {exc}\n"
        with open(self.path, "a") as f:
            f.write(f"--- t {t:.0f} s\n{out}")


class Watchdog:
    """Reads the guest's console as it grows (only the new bytes at each poll): progress is a
    change of the monitor thread's swap counters (``out N in M``) or a new line of the guest
    script; armed once the workload starts. Says when a memserver kill is due (the fill
    reached `kill_at_pct`)."""

    MONITOR = re.compile(r"duvm-guest: monitor \S+ out (\d+) in (\d+)")

    def __init__(self, console: Path, stall_s: float | None, kill_at_pct: int | None) -> None:
        self.console = console
        self.stall_s = stall_s
        self.kill_mark = (
            f"duvm-guest: workload fill {kill_at_pct}%" if kill_at_pct is not None else None
        )
        self.armed = False
        self.hung = False
        self.kill_due = False
        self._offset = 0  # console bytes consumed, up to the last complete line
        self._counters: tuple[str, str] | None = None  # the last monitor line's
        self._lines = 0  # the guest script's own lines (not the monitor's)
        self._key: tuple[object, ...] | None = None
        self._since = 0.0

    def _consume(self) -> None:
        try:
            with open(self.console, "rb") as f:
                f.seek(self._offset)
                new = f.read()
        except OSError:
            return
        done = new.rfind(b"\n") + 1  # a partly written last line waits for the next poll
        self._offset += done
        for line in new[:done].decode(errors="replace").splitlines():
            if self.kill_mark is not None and self.kill_mark in line:
                self.kill_due = True
            if "duvm-guest: workload fill" in line:
                self.armed = True
            if m := self.MONITOR.search(line):
                self._counters = (m.group(1), m.group(2))
            if line.startswith("duvm-guest:") and "monitor" not in line:
                self._lines += 1

    def poll(self, now: float) -> None:
        was_armed = self.armed
        self._consume()
        if not was_armed:
            self._since = now
            return
        key = (self._counters, self._lines)
        if key != self._key:
            self._key, self._since = key, now
        elif self.stall_s is not None and now - self._since > self.stall_s:
            self.hung = True


# What a hung run's console gets before QEMU is stopped: blocked tasks (w), memory (m), the
# running CPU's backtrace (l: a vCPU busy in the kernel shows where), every task (t)
HUNG_SYSRQ, HUNG_SYSRQ_FLUSH_S = "wmlt", 8.0


def sysrq(monitor: Path, keys: str) -> None:
    """Press Alt-SysRq-KEY in the guest for each key, through QEMU's monitor socket (the
    guest's PS/2 keyboard): w = blocked tasks with their stacks, m = memory state, l = the
    backtrace of each running CPU, t = every
    task with its stack (running ones too: a livelock in reclaim shows only there); the kernel
    prints them on the console even when no process in the guest can run any more."""
    import socket

    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(monitor))
        # The guest boots with loglevel=4, and the dumps are printed at KERN_INFO: console
        # log level 9 first, or only their headers reach the console.
        for key in "9" + keys:
            s.sendall(f"sendkey alt-sysrq-{key}\n".encode())
            time.sleep(2)


def cluster_secret(python: str, work: Path) -> Path:
    """A new cluster secret in `work` (the guest sees it at the same path, over 9p)."""
    secret = work / "cluster.secret"
    subprocess.run(
        [python, "-m", "duvm.cli", "secret", "generate", str(secret)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return secret


def start_qemu(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """QEMU started in its own process group (`kill_group` ends it and anything it started),
    its output in `log`, and killed by the kernel if this process dies first."""
    with open(log, "wb") as qlog:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=qlog,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def read_text(path: Path) -> str:
    """A guest's log, or "" when it was never written."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def summary(run: GuestRun) -> dict[str, Any]:
    """Timings and counters of one run, for people (the test asserts on the raw events)."""
    ev = run.events
    work = ev.get("workload", {})
    before = ev.get("start", {}).get("vmstat", {})
    after = work.get("vmstat", {})
    return {
        "qemu_seconds": run.seconds,
        "timed_out": run.timed_out,
        "guest_exit": run.guest_exit,
        "booted_at": next(
            (float(m.split()[1]) for m in run.markers if m.startswith("DUVM-GUEST-BOOTED ")), None
        ),
        "script_started_at": ev.get("start", {}).get("uptime"),
        "enable_seconds": ev.get("enable", {}).get("seconds"),
        "workload_started_at": ev.get("attached", {}).get("uptime"),
        "fill_seconds": work.get("result", {}).get("fill_s") if work.get("result") else None,
        "verify_seconds": work.get("result", {}).get("verify_s") if work.get("result") else None,
        "disable_seconds": ev.get("disable", {}).get("seconds"),
        "pages_out": after.get("pswpout", 0) - before.get("pswpout", 0) if after else None,
        "pages_in": after.get("pswpin", 0) - before.get("pswpin", 0) if after else None,
        "bad_chunks": work.get("result", {}).get("bad_chunks") if work.get("result") else None,
        "mem_total_kb": ev.get("start", {}).get("mem_total_kb"),
        "memservers_used_pages_after": [
            None if s is None else s.get("used_pages") for s in run.memservers_after
        ]
        or [m.get("used_pages") for m in ev.get("detached", {}).get("memservers", [])],
        "runs": [
            {
                "seconds": r.get("seconds"),
                "fill_seconds": (r.get("result") or {}).get("fill_s"),
                "verify_seconds": (r.get("result") or {}).get("verify_s"),
                "bad_chunks": (r.get("result") or {}).get("bad_chunks"),
                "pages_out": r.get("pages_out"),
                "pages_in": r.get("pages_in"),
                "memservers_used_pages": [m.get("used_pages") for m in r.get("memservers", [])],
                "swap_used": (r.get("proc_swaps") or "").splitlines()[1:],
            }
            for r in (ev[k] for k in sorted(ev) if re.fullmatch(r"run\d+", k))
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="boot the duvm kernel-nbd test guest once")
    p.add_argument("--mib", type=int, default=48, help="workload size (MiB)")
    p.add_argument("--mem", type=int, default=384, help="guest RAM (MiB)")
    p.add_argument(
        "--cgroup",
        type=int,
        default=24,
        help="memory cgroup limit of the "
        "workload in MiB; 0: no cgroup, the workload outgrows the guest's RAM",
    )
    p.add_argument("--swap-size", default="128M")
    p.add_argument("--memservers", type=int, default=1)
    p.add_argument("--capacity", default="128M", help="per memserver")
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument(
        "--host-memservers",
        action="store_true",
        help="run the memservers on the host, reached through QEMU's user network",
    )
    p.add_argument(
        "--network",
        choices=("user", "tap"),
        default="user",
        help="guest network: QEMU user mode (slirp), or a tap device in a private "
        "network namespace (with --host-memservers: they run in it)",
    )
    p.add_argument(
        "--sysrq-at",
        type=float,
        action="append",
        metavar="S",
        help="S seconds after QEMU starts, print the guest's blocked tasks, its "
        "memory state and every task's stack on its console (SysRq w, m and t; repeatable)",
    )
    p.add_argument(
        "--daemon-args",
        default="",
        metavar="ARGS",
        help="extra `duvm daemon` flags in the guest (space-separated)",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        metavar="PCT",
        help="SIGKILL the daemon at PCT %% of the fill, then `duvm enable --resume`",
    )
    p.add_argument(
        "--order",
        choices=("sequential", "random"),
        default="sequential",
        help="the workload's touch order",
    )
    p.add_argument("--chunk-kib", type=int, default=1024, help="the workload's chunk (KiB)")
    p.add_argument("--passes", type=int, default=1, help="verification passes")
    p.add_argument(
        "--baseline-nbdkit",
        action="store_true",
        help="nbdkit in duvm's place (nbdkit memory here, nbdkit nbd relaying in the guest), "
        "for the same workload's time against duvm's",
    )
    p.add_argument(
        "--swap-no-discard",
        action="store_true",
        help="an experiment: swap on again without --discard after `duvm enable`, so freed "
        "swap slots are never trimmed (what a long-lived daemon costs without discard)",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=1,
        help="run the workload this many times against the same daemon (a long-lived one)",
    )
    p.add_argument(
        "--stall",
        type=float,
        metavar="S",
        help="end the run as hung when no page moves for S seconds",
    )
    p.add_argument(
        "--kill-memserver-at",
        type=int,
        choices=(25, 50, 75),
        metavar="PCT",
        help="SIGKILL the last host memserver at PCT %% of the fill (25, 50, 75)",
    )
    p.add_argument(
        "--stop-memserver-at",
        type=int,
        choices=(25, 50, 75),
        metavar="PCT",
        help="SIGSTOP the last host memserver at PCT %% of the fill, SIGCONT 20 s later",
    )
    p.add_argument(
        "--reproduction",
        action="store_true",
        help="with --host-memservers: plain `duvm enable --peers --size "
        "--secret-file` in the guest and an os.urandom workload (issue 18's steps)",
    )
    p.add_argument(
        "--sysctl",
        default="",
        metavar="'NAME=VALUE ...'",
        help="kernel settings for the guest at boot, e.g. 'kernel.sched_rt_runtime_us=-1'",
    )
    p.add_argument(
        "--method",
        choices=("kernel-nbd", "nbdfuse-loop"),
        default="kernel-nbd",
        help="how the guest's duvm attaches (nbdfuse-loop: the fallback without kernel nbd)",
    )
    p.add_argument("--keep", type=Path, help="keep logs in this folder")
    a = p.parse_args(argv)
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
    try:
        run = run_guest(
            workload_mib=a.mib,
            cgroup_mib=a.cgroup or None,
            swap_size=a.swap_size,
            mem_mib=a.mem,
            memservers=a.memservers,
            capacity=a.capacity,
            timeout_s=a.timeout,
            host_memservers=a.host_memservers,
            kill_at_pct=a.kill_at,
            network=a.network,
            sysrq_at=a.sysrq_at,
            daemon_args=a.daemon_args,
            order=a.order,
            chunk_kib=a.chunk_kib,
            passes=a.passes,
            runs=a.runs,
            baseline_nbdkit=a.baseline_nbdkit,
            swap_no_discard=a.swap_no_discard,
            stall_s=a.stall,
            kill_memserver_at=a.kill_memserver_at,
            stop_memserver_at=a.stop_memserver_at,
            reproduction=a.reproduction,
            sysctl=a.sysctl,
            method=a.method,
            workdir=a.keep,
        )
    except GuestUnavailable as exc:
        print(f"boot: cannot boot the guest here: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary(run), indent=2))
    ok = run.guest_exit == 0 and not run.timed_out
    if not ok:
        print(run.console_tail(), file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
