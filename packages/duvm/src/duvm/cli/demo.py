"""`duvm demo`: a whole pool on one machine, as a first-time user would try it (root).

Theory of operation
-------------------
1. Preflight: root, a way to attach (kernel nbd, or nbdfuse + loop), a memory cgroup and the
   swap tools; each missing piece is named with the package that provides it.
2. Three memservers on 127.0.0.1 (ports picked by the kernel), our own children. They and the
   daemon prove a temporary cluster secret (0600, in the state directory, removed at the end),
   as a real cluster's nodes do; ``--no-secret`` runs them unauthenticated, which loopback
   allows.
3. ``duvm enable`` against them, with its own state directory so a real enablement on this
   machine is left alone.
4. The workload (:mod:`duvm.cli.workload`) in a memory cgroup limited to a quarter (or so) of what
   it holds: the kernel swaps most of it to the duvm device, i.e. into the memservers' RAM, and
   back while every byte is verified. A sampler thread polls each memserver's STATUS for the
   progress line: what moved where is each memserver's page counters (pages stored = out,
   loaded = in) over the workload, and the peak pages it held. The kernel's pswpout/pswpin are
   shown too, labelled machine-wide (other swapping on the machine counts there).
5. ``duvm disable``; then every memserver is shown back at 0 pages (discard and the released
   reservation reached them).

Everything is torn down in ``finally``: the cgroup (killing the workload if needed), the
enablement (daemon, device, swap) and the memservers, except when swapoff fails: swap is
shared by the whole machine, so the device may hold other programs' pages too, and the daemon
and memservers then keep running (the message says how to finish) rather than lose them.
``--json`` prints the measured result as one object, which the end-to-end test asserts on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from duvm.base import cgroup
from duvm.base.units import parse_size
from duvm.node.attach import (
    attach_fuse,
    attach_kernel,
    attach_state,
    kernel_swap,
    kernelnbd,
    systools,
)
from duvm.node.lifecycle import control
from duvm.node.lifecycle.config import with_secret
from duvm.wire import auth

PAGE = 4096
MAX_PRIORITY = 32767
_LISTEN_RE = re.compile(r"listening on (\S+):(\d+)")


@dataclass
class DemoResult:
    workload_mib: int
    limit_mib: int
    replicas: int | None = None  # copies of each page the daemon keeps
    method: str | None = None
    device: str | None = None
    intact: bool | None = None
    workload: dict[str, Any] | None = None
    pswpout: int | None = None
    pswpin: int | None = None
    peak_pages: dict[str, int] = field(default_factory=dict)
    # per memserver, during the workload: pages it received (STORE), sent back (LOAD), freed
    stored_pages: dict[str, int | None] = field(default_factory=dict)
    loaded_pages: dict[str, int | None] = field(default_factory=dict)
    freed_pages: dict[str, int | None] = field(default_factory=dict)
    authenticated: bool | None = None  # memservers and daemon proved a (temporary) secret
    pages_after_disable: dict[str, int | None] = field(default_factory=dict)
    reserved_after_disable: dict[str, int | None] = field(default_factory=dict)
    swapoff_ok: bool | None = None
    seconds: float | None = None
    error: str | None = None
    # what it started, so a caller can check that nothing is left behind
    pids: list[int] = field(default_factory=list)
    cgroup: str | None = None


def preflight() -> list[str]:
    """Why the demo cannot run here (empty: it can), each with what to install or do."""
    problems = []
    if os.geteuid() != 0:
        problems.append(
            "needs root (it creates a swap device, a loop device and a cgroup): run it with sudo"
        )
    for tool in ("mkswap", "swapon", "swapoff", "blkdiscard"):
        if systools.find_tool(tool) is None:
            problems.append(f"{tool} missing: install {systools.TOOL_PACKAGES[tool]}")
    if not kernelnbd.kernel_has_nbd():
        fuse = attach_fuse.problems()
        if fuse and systools.find_tool("modprobe") is None:
            problems.append(
                "no kernel nbd module (install kmod and a kernel with nbd) and the "
                "nbdfuse fallback is missing: " + "; ".join(fuse)
            )
        elif fuse:
            problems.append(
                "kernel nbd is not loaded (`modprobe nbd` may fix it) and the "
                "nbdfuse fallback is missing: " + "; ".join(fuse)
            )
    if cgroup.detect_version() is None:
        problems.append("no cgroup memory controller (mount cgroup v2, or v1 with memory)")
    return problems


def competing_swaps() -> list[str]:
    """Active swap devices at the highest priority: the kernel would spread the workload's
    pages over them and the demo's device, so part of what it shows would go elsewhere."""
    try:
        entries = kernel_swap.parse_proc_swaps(Path("/proc/swaps").read_text())
    except OSError:
        return []
    return [e.filename for e in entries if e.priority >= MAX_PRIORITY]


class Memservers:
    """N local memserver processes on loopback ports the kernel picks; close() stops them."""

    def __init__(self, count: int, capacity: int, secret_file: Path | None = None) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.addrs: list[str] = []
        extra = ["--secret-file", str(secret_file)] if secret_file else []
        shown: set[str] = set()
        try:
            for _ in range(count):
                p = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "duvm.cli",
                        "memserver",
                        "--listen",
                        "127.0.0.1:0",
                        "--capacity",
                        str(capacity),
                        *extra,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    stdin=subprocess.DEVNULL,
                )
                self.procs.append(p)
                assert p.stdout is not None
                # "... listening on HOST:PORT ..." once it serves; warnings may come first
                # (a protection it could not apply), and are shown as they are
                said: list[str] = []
                while (line := p.stdout.readline()) and not (m := _LISTEN_RE.search(line)):
                    said.append(line)
                    if line not in shown:  # each memserver warns alike: once is enough
                        shown.add(line)
                        print(line.rstrip("\n"), file=sys.stderr)
                if not line:
                    p.wait()
                    raise control.ControlError(f"memserver did not start: {''.join(said).strip()}")
                self.addrs.append(f"{m.group(1)}:{m.group(2)}")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def release(self) -> None:
        """Leave the memservers running on their own (their output is no longer read)."""
        for p in self.procs:
            if p.stdout:
                p.stdout.close()
        self.procs = []

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
            if p.stdout:
                p.stdout.close()


class Sampler(threading.Thread):
    """Polls memserver STATUS: latest and peak used pages, and the page counters (stored,
    loaded, freed since the memserver started) per memserver."""

    def __init__(self, addrs: list[str], interval: float = 0.25, security: Any = None) -> None:
        super().__init__(daemon=True)
        self.addrs, self.interval, self.security = addrs, interval, security
        self.latest: dict[str, int | None] = dict.fromkeys(addrs)
        self.peak: dict[str, int] = dict.fromkeys(addrs, 0)
        self.counters: dict[str, dict[str, int] | None] = dict.fromkeys(addrs)
        self.stop = threading.Event()
        self.error: str | None = None

    def sample(self) -> None:
        for st in control.peer_statuses(self.addrs, timeout=2.0, security=self.security):
            self.latest[st["peer"]] = st["pages"]
            if st["pages"] is not None:
                self.peak[st["peer"]] = max(self.peak[st["peer"]], st["pages"])
            if isinstance(st.get("counters"), dict):
                self.counters[st["peer"]] = st["counters"]

    def moved(self, since: dict[str, dict[str, int] | None], key: str) -> dict[str, int | None]:
        """Per memserver, how much counter `key` grew since `since` (None: unknown)."""
        out: dict[str, int | None] = {}
        for addr in self.addrs:
            now, then = self.counters.get(addr), since.get(addr)
            out[addr] = (
                now[key] - then[key] if now and then and key in now and key in then else None
            )
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # a display helper must never take the demo down
                self.error = str(exc)
            self.stop.wait(self.interval)


def _vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, _, v = line.partition(" ")
        out[k] = int(v)
    return out


def _mib(pages: int | None) -> str:
    return "n/a" if pages is None else f"{pages * PAGE >> 20} MiB"


def _progress_line(
    phase: str,
    done: int,
    total: int,
    sampler: Sampler,
    device: str,
    since: dict[str, dict[str, int] | None],
) -> str:
    entry = kernel_swap.swap_entry(device)
    swap = "n/a" if entry is None else f"{entry.used_kb >> 10} MiB"
    held = " ".join(f"{_mib(v):>7}" for v in sampler.latest.values())
    out, back = sampler.moved(since, "pages_stored"), sampler.moved(since, "pages_loaded")
    total_out = None if None in out.values() else sum(v or 0 for v in out.values())
    total_in = None if None in back.values() else sum(v or 0 for v in back.values())
    pct = 100 * done // max(total, 1)
    return (
        f"  {phase:<8} {pct:3d}%  swap used {swap:>8}  stored {_mib(total_out):>8}  "
        f"loaded {_mib(total_in):>8}  held per memserver {held}"
    )


def demo_method(method: str) -> str:
    """The attach method the demo passes to enable: "auto" names kernel nbd where the kernel
    has it, else the nbdfuse + loop fallback. `auto` alone would refuse the fallback, which
    can hang a node short of memory as a whole; the demo's workload runs in a memory cgroup
    with a RAM limit, so the machine itself never runs short."""
    if method != "auto":
        return method
    return attach_state.METHOD_KERNEL if attach_kernel.available() else attach_state.METHOD_FUSE


def run_demo(args: argparse.Namespace, out: TextIO) -> DemoResult:
    res = DemoResult(args.mib, args.limit_mib)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=out, flush=True))
    started = time.monotonic()
    tty = out.isatty() and not args.json
    size = args.size or ((args.mib + args.mib // 2) << 20)
    capacity = max(size * args.replicas // 3 + (16 << 20), 32 << 20)
    secret = args.state_dir / "demo.secret" if args.secret else None
    # The highest swap priority: the demo's device is the first the kernel uses, in front of
    # any local swap, so the pages it shows moving are the workload's.
    cfg = control.Config(
        peers=[],
        size=size,
        replicas=args.replicas,
        method=demo_method(args.method),
        state_dir=args.state_dir,
        secret_file=secret,
        priority=MAX_PRIORITY,
        daemon_args=with_secret([], secret),
    )
    servers: Memservers | None = None
    sampler: Sampler | None = None
    enabled = False
    try:
        how = (
            "authenticated with a temporary cluster secret"
            if secret
            else "on loopback, without a secret (--no-secret)"
        )
        say(f"1/5 starting 3 memservers ({capacity >> 20} MiB of RAM each, {how})")
        if secret is not None:
            write_temporary_secret(secret)
        servers = Memservers(3, capacity, secret)
        res.pids += servers.pids
        cfg.peers = servers.addrs
        cfg.validate()
        res.replicas = cfg.replicas
        res.authenticated = secret is not None
        security = control.peer_security(cfg.daemon_args, cfg.peers)
        say("    " + ", ".join(servers.addrs))
        say(f"2/5 duvm enable: {size >> 20} MiB swap device, {args.replicas} replica(s)")
        att = control.enable(cfg)
        enabled = True
        res.method, res.device = att.method, att.device
        res.pids += [
            p
            for p in (att.extra.get("daemon_pid"), att.nbdfuse_pid, att.holder_pid)
            if isinstance(p, int)
        ]
        say(f"    {att.device} via {att.method}")
        say(
            f"3/5 workload: {args.mib} MiB of random data in a cgroup limited to "
            f"{args.limit_mib} MiB"
        )
        sampler = Sampler(servers.addrs, security=security)
        sampler.sample()
        since = dict(sampler.counters)
        sampler.start()
        before = _vmstat()
        with cgroup.MemoryCgroup(args.limit_mib << 20, prefix="duvm-demo") as cg:
            res.cgroup = str(cg.path)
            proc = cg.popen(
                [sys.executable, "-m", "duvm.cli.workload", "--mib", str(args.mib), "--progress"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                stdin=subprocess.DEVNULL,
            )
            assert proc.stderr is not None and proc.stdout is not None
            last = 0.0
            for line in proc.stderr:
                parts = line.split()
                if len(parts) == 4 and parts[0] == "progress":
                    now = time.monotonic()
                    done, total = int(parts[2]), int(parts[3])
                    if now - last > (0.2 if tty else 2.0) or done == total:
                        last = now
                        text = _progress_line(
                            parts[1], done, total, sampler, att.device or "", since
                        )
                        if tty:
                            out.write("\r" + text)
                            out.flush()
                        else:
                            say(text)
            stdout = proc.stdout.read()
            proc.wait()
        if tty:
            out.write("\n")
        after = _vmstat()
        sampler.stop.set()
        sampler.join(10)
        sampler.sample()
        res.pswpout = after["pswpout"] - before["pswpout"]
        res.pswpin = after["pswpin"] - before["pswpin"]
        res.peak_pages = dict(sampler.peak)
        res.stored_pages = sampler.moved(since, "pages_stored")
        res.loaded_pages = sampler.moved(since, "pages_loaded")
        res.freed_pages = sampler.moved(since, "pages_freed")
        lines = stdout.strip().splitlines()
        res.workload = json.loads(lines[-1]) if lines else None
        res.intact = proc.returncode == 0 and bool(res.workload and res.workload["intact"])
        verdict = "every byte intact" if res.intact else f"FAILED (exit {proc.returncode})"
        say(f"    verified: {verdict}")
        copies = f"; each page on {cfg.replicas} memservers" if (cfg.replicas or 1) > 1 else ""
        say(f"    what moved where (out = stored on the memserver, in = loaded back{copies}):")
        say(f"      {'memserver':<22} {'out':>14} {'in':>14} {'peak held':>14}")
        for addr in servers.addrs:
            say(
                f"      {addr:<22} {_mib(res.stored_pages[addr]):>14} "
                f"{_mib(res.loaded_pages[addr]):>14} {_mib(res.peak_pages[addr]):>14}"
            )
        say(
            f"    the kernel (whole machine, /proc/vmstat): swapped out {_mib(res.pswpout)}, "
            f"in {_mib(res.pswpin)}"
        )

        say("4/5 duvm disable (swapoff first)")
        try:
            control.disable(cfg.state_dir)
            res.swapoff_ok = True
            enabled = False
        except attach_state.SwapoffFailed as exc:
            res.swapoff_ok = False
            raise control.ControlError(str(exc)) from exc
        say("5/5 memservers after disable:")
        deadline = time.monotonic() + 15
        while True:
            sts = control.peer_statuses(servers.addrs, security=security)
            if (
                all(s["pages"] == 0 and s.get("reserved_pages") == 0 for s in sts)
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.2)
        for s in sts:
            res.pages_after_disable[s["peer"]] = s["pages"]
            res.reserved_after_disable[s["peer"]] = s.get("reserved_pages")
            say(
                f"      {s['peer']:<22} {s['pages'] if s['pages'] is not None else 'n/a':>8} "
                f"pages, {s.get('reserved_pages', 'n/a')} reserved"
            )
    except (control.ControlError, attach_state.AttachError, cgroup.CgroupError) as exc:
        res.error = str(exc)
    finally:
        if sampler is not None:
            sampler.stop.set()
        if enabled:
            try:
                control.disable(cfg.state_dir, force=True)
                enabled = False
            except (control.ControlError, attach_state.AttachError) as exc:
                res.error = (res.error or "") + f"; cleanup: {exc}"
        if servers is not None and enabled:
            # swapoff failed: swapped pages (maybe other programs' too: swap is shared by the
            # whole machine) still live in these memservers. Stopping them would lose those
            # pages, so they keep running, and the message says how to finish by hand.
            res.error = (res.error or "") + (
                f"; left running so that no swapped page is lost: the swap device, its daemon "
                f"and the memservers (pids {' '.join(map(str, servers.pids))}). Free memory, run "
                f"`duvm disable --state-dir {cfg.state_dir}`, then stop those pids"
            )
            servers.release()
        elif servers is not None:
            servers.close()
        if secret is not None and not enabled:
            secret.unlink(missing_ok=True)
        res.seconds = round(time.monotonic() - started, 2)
    return res


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=int, default=256, help="workload size in MiB")
    parser.add_argument(
        "--limit-mib", type=int, default=64, help="RAM limit of the workload's cgroup in MiB"
    )
    parser.add_argument(
        "--size", type=parse_size, default=None, help="swap device size (default 1.5x the workload)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="copies of each page on the 3 memservers (1-3; default 2, as "
        "`duvm enable` with 2 or more peers)",
    )
    parser.add_argument(
        "--method",
        choices=("auto", attach_state.METHOD_KERNEL, attach_state.METHOD_FUSE),
        default="auto",
        help="auto (the default): kernel nbd where the kernel has it, else the nbdfuse+loop "
        "fallback (safe here: the workload's cgroup keeps the machine from running short)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/run/duvm-demo"),
        help="state directory, apart from a real enablement's",
    )
    parser.add_argument(
        "--no-secret",
        dest="secret",
        action="store_false",
        help="run the memservers without authentication (allowed on loopback); "
        "by default the demo makes a temporary cluster secret, as a real "
        "cluster uses one",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON only")


def write_temporary_secret(path: Path) -> None:
    """A fresh cluster secret, created 0600 (never readable by others, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a leftover of an interrupted demo
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# duvm demo: temporary cluster secret, removed when the demo ends\n")
        f.write(auth.new_secret_line() + "\n")


def _raise_on_signal(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    # SIGTERM (e.g. `timeout`) must unwind through the cleanup like Ctrl-C does
    signal.signal(signal.SIGTERM, _raise_on_signal)
    problems = preflight()
    if problems:
        print("duvm demo cannot run here:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 1
    if args.mib <= args.limit_mib or args.limit_mib < 16:
        print(
            "duvm demo: --mib must exceed --limit-mib (>= 16) so the workload swaps",
            file=sys.stderr,
        )
        return 2
    others = competing_swaps()
    if others and not args.json:
        print(
            f"duvm demo: note: swap {', '.join(others)} is active at the highest priority "
            f"({MAX_PRIORITY}); the kernel shares the workload's pages between it and the "
            "demo's device",
            file=sys.stderr,
        )
    try:
        res = run_demo(args, sys.stdout)
    except KeyboardInterrupt:
        print(
            "\nduvm demo interrupted; everything it started was stopped and removed",
            file=sys.stderr,
        )
        return 130
    if args.json:
        print(json.dumps(asdict(res)))
    elif res.error:
        print(f"duvm demo failed: {res.error}", file=sys.stderr)
    else:
        back = all(v == 0 for v in res.pages_after_disable.values())
        print(
            f"done in {res.seconds:.1f} s: data {'intact' if res.intact else 'CORRUPTED'}, "
            f"memservers {'all back at 0 pages' if back else 'NOT all back at 0 pages'}"
        )
    ok = res.error is None and res.intact and res.swapoff_ok
    return 0 if ok else 1
