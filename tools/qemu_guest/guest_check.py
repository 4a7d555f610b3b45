"""Runs inside the QEMU test guest: `duvm enable` on the kernel's nbd driver, a workload bigger
than the guest's RAM, verified, then `duvm disable`. Reports facts, judges nothing.

Theory of operation
-------------------
``init.sh`` starts this with the host's Python in ``chroot /host`` (the host's / over 9p), so
it runs the project's own ``duvm`` commands exactly as a user would: ``duvm enable --method
kernel-nbd`` starts the daemon (which reserves the swap device's capacity on the memservers,
running on the host and reached through QEMU's user network at 10.0.2.2), attaches /dev/nbd0
through the holder process (NBD_SET_SOCK / NBD_DO_IT), raises vm.min_free_kbytes and turns swap
on. The workload (``python -m duvm.cli.workload``) then fills more random data than the guest has
RAM, so the kernel must swap most of it out to /dev/nbd0, and reads every byte back.

Each step's observations (/proc/swaps, /sys/block/nbd0/pid and the holder's command line,
/proc/vmstat counters, ``duvm status --json``, exit codes, timings) go out as one JSON object
per line, prefixed ``DUVM-RESULT``, on the second serial port (/dev/ttyS1), which the host
captures to a file. The host-side test decides what passed. Parameters come from the
environment (``DUVM_PEERS``, ``DUVM_SIZE``, ``DUVM_MIB``), set by ``duvm.env`` in the initramfs.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import guest_cut  # beside this script
import guest_fork

RESULT_PORT = "/dev/ttyS1"
STATE_DIR = "/run/duvm"
T0 = time.monotonic()


def emit(event: str, **data: Any) -> None:
    data = {"event": event, "t": round(time.monotonic() - T0, 2), "uptime": _uptime(), **data}
    line = "DUVM-RESULT " + json.dumps(data) + "\n"
    with open(RESULT_PORT, "w") as port:
        port.write(line)
    print(f"duvm-guest: {event} at {data['uptime']} s", flush=True)


def _uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key in ("pswpin", "pswpout"):
            out[key] = int(value)
    return out


def duvm(*args: str, timeout: float = 300) -> dict[str, Any]:
    """Run `duvm ARGS` as a user would (python -m duvm.cli); rc, output and seconds."""
    t = time.monotonic()
    try:
        res = subprocess.run(
            [sys.executable, "-m", "duvm.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        return {
            "rc": None,
            "stdout": str(exc.stdout),
            "stderr": f"timed out after {timeout} s",
            "seconds": round(time.monotonic() - t, 2),
        }
    return {
        "rc": res.returncode,
        "stdout": res.stdout[-3000:],
        "stderr": res.stderr[-3000:],
        "seconds": round(time.monotonic() - t, 2),
    }


def worker_facts() -> dict[str, Any]:
    """A daemon with several workers (DUVM_WORKERS): the pids its status names, its kernel nbd
    connections, the hardware queues the driver made for them (one per connection) and the
    bytes each worker has read from its sockets and files so far (/proc/PID/io `rchar`: the
    pages of the requests it served, and the memservers' replies to it)."""
    st = status() or {}
    pids = (st.get("daemon") or {}).get("workers") or []
    read = {}
    for pid in pids:
        io = dict(line.split(": ", 1) for line in (_read(f"/proc/{pid}/io") or "").splitlines())
        read[str(pid)] = int(io["rchar"]) if "rchar" in io else None
    mq = "/sys/block/nbd0/mq"
    return {
        "pids": pids,
        "connections": st.get("connections"),
        "hw_queues": sorted(os.listdir(mq)) if os.path.isdir(mq) else None,
        "read_bytes": read,
    }


def status() -> dict[str, Any] | None:
    """What `duvm status --json` prints, computed in this process: a new interpreter costs
    5-25 s under TCG, the call itself well under one."""
    from duvm.node.lifecycle import control

    try:
        return control.status(Path(STATE_DIR))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def device_facts(nbd: str = "nbd0") -> dict[str, Any]:
    pid_text = _read(f"/sys/block/{nbd}/pid")
    holder_cmdline = None
    if pid_text is not None and pid_text.strip().isdigit():
        raw = _read(f"/proc/{pid_text.strip()}/cmdline")
        holder_cmdline = raw.replace("\0", " ").strip() if raw else None
    size = _read(f"/sys/block/{nbd}/size")
    return {
        "proc_swaps": _read("/proc/swaps"),
        "nbd_pid": pid_text.strip() if pid_text else None,
        "holder_cmdline": holder_cmdline,
        "nbd_size_bytes": int(size) * 512 if size and size.strip().isdigit() else None,
        "nbd_module_loaded": os.path.isdir("/sys/module/nbd"),
        "wbt_lat_usec": (_read(f"/sys/block/{nbd}/queue/wbt_lat_usec") or "").strip() or None,
        "min_free_kbytes": int(Path("/proc/sys/vm/min_free_kbytes").read_text()),
        "watermark_boost_factor": int(Path("/proc/sys/vm/watermark_boost_factor").read_text()),
        "state_files": sorted(os.listdir(STATE_DIR)) if os.path.isdir(STATE_DIR) else [],
        # the daemon serving, and the standby the supervisor keeps beside it (D48): until a
        # takeover only the standby's command line carries --standby-fd
        "daemon_pids": [p for p in _pids_with("duvm.cli\0daemon") if p not in _standbys()],
        "standby_pids": _standbys(),
        "holder_pids": _pids_with("duvm.node.attach.kernelnbd"),
        "supervisor_pids": _pids_with("duvm.cli\0supervise"),
        "daemon_policies": [_policy(p) for p in _pids_with("duvm.cli\0daemon")],
        "daemon_state_mount": _mount_type(STATE_DIR + "/daemon-state"),
    }


def _mount_type(path: str) -> str | None:
    """The filesystem type mounted exactly on `path` (None: no mount there)."""
    found = None
    for line in (_read("/proc/self/mounts") or "").splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[1] == path:
            found = fields[2]
    return found


def _policy(pid: int) -> int | None:
    """A process's scheduling policy (0 normal, 2 SCHED_RR), /proc/PID/stat field 41."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[41 - 3])
    except (OSError, ValueError, IndexError):
        return None


def logs() -> dict[str, str | None]:
    """The tails of the daemon's and the holder's logs (why a connection ended); "daemon" is
    the log of the daemon serving now (a standby that took over keeps its own)."""
    out = {
        name: (text[-2000:] if (text := _read(f"{STATE_DIR}/{name}")) is not None else None)
        for name in ("daemon.log", "holder-nbd0.log", "supervisor.log")
    }
    try:
        current = json.loads(_read(f"{STATE_DIR}/daemon.json") or "{}").get("log")
    except ValueError:
        current = None
    out["daemon"] = (_read(current) or "")[-2000:] if current else None
    return out


def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The `Key:   N kB` lines of a /proc file that `keys` names, in KiB ({} when unreadable)."""
    out = {}
    for line in (_read(path) or "").splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            out[key] = int(rest.split()[0])
    return out


def meminfo() -> dict[str, int]:
    return _kib_fields(
        "/proc/meminfo", ("MemTotal", "MemFree", "MemAvailable", "SwapTotal", "SwapFree", "Mlocked")
    )


def _standbys() -> list[int]:
    return _pids_with("--standby-fd")


def _pids_with(needle: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                continue
    return found


def _task(pid: int) -> str:
    """'STATE wchan' of a process, and its kernel stack's top frames while it is blocked."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
    except OSError:
        return "gone"
    out = f"{state} {wchan}"
    if state == "D":
        stack = _read(f"/proc/{pid}/stack") or ""
        out += (
            " ["
            + " < ".join(f.split()[-1].split("+")[0] for f in stack.splitlines()[:6] if f.split())
            + "]"
        )
    return out


def _children(pid: int) -> list[int]:
    """The children of every thread of `pid` (procfs keeps these lists in the kernel: reading
    them never waits for a swapped-out page, unlike a process's cmdline)."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        found += [int(c) for c in (_read(f"/proc/{pid}/task/{tid}/children") or "").split()]
    return found


def watch_the_restart(
    supervisor: int, t: float, done: threading.Event, every: float = 10.0
) -> None:
    """After the kill, until the new daemon serves: what the supervisor's threads and the
    processes it started are waiting on (a restart that never serves shows where it stopped;
    nothing here reads a file that could be swapped out)."""
    while not done.wait(every):
        kids = _children(supervisor)
        print(
            f"duvm-guest: restart {time.monotonic() - t:.0f}s supervisor {supervisor} "
            f"{_threads(supervisor, every=True)}"
            + "".join(f" child {k} {_threads(k, every=True)}" for k in kids),
            flush=True,
        )


def _memory(pid: int) -> dict[str, int]:
    """A process's resident and locked memory in KiB (/proc/PID/status)."""
    return _kib_fields(f"/proc/{pid}/status", ("VmRSS", "RssAnon", "RssFile", "VmLck", "VmPin"))


def _state_pids(name: str, key: str) -> list[int]:
    try:
        pid = json.loads(Path(STATE_DIR, name).read_text()).get(key)
    except (OSError, ValueError):
        return []
    return [pid] if isinstance(pid, int) else []


# The daemon's pid for the monitor, refreshed by whoever (re)starts it: the monitor itself must
# not read duvm's state files, which sit on a tmpfs whose pages can be swapped out to the very
# device that is stalled.
WATCHED: dict[str, list[int]] = {"daemon": []}


def watch_daemon() -> None:
    WATCHED["daemon"] = _state_pids("daemon.json", "pid")


# /proc/net/tcp's state numbers (include/net/tcp_states.h)
TCP_STATES = {
    1: "est",
    2: "syn-sent",
    3: "syn-recv",
    4: "fin-wait1",
    5: "fin-wait2",
    6: "time-wait",
    7: "close",
    8: "close-wait",
    9: "last-ack",
    10: "listen",
    11: "closing",
}


def tcp_queues(ports: set[int]) -> str:
    """Each TCP connection to the memservers (/proc/net/tcp): send/receive queue bytes, its
    state where not established, and its unanswered retransmission timeouts where any (a
    connection that lost its peer shows them climbing)."""
    out = []
    for line in (_read("/proc/net/tcp") or "").splitlines()[1:]:
        f = line.split()
        if len(f) > 6 and int(f[2].split(":")[1], 16) in ports:
            tx, rx = (int(x, 16) for x in f[4].split(":"))
            state, timeouts = int(f[3], 16), int(f[6], 16)
            extra = "" if state == 1 else f" {TCP_STATES.get(state, state)}"
            extra += f" rto{timeouts}" if timeouts else ""
            out.append(f"{tx}/{rx}{extra}")
    snmp = (_read("/proc/net/snmp") or "").splitlines()
    tcp = [x.split() for x in snmp if x.startswith("Tcp:")]
    retrans = dict(zip(tcp[0], tcp[1], strict=False)).get("RetransSegs") if len(tcp) == 2 else None
    return f"tcp tx/rx {','.join(out) or '-'} retrans {retrans}"


def _threads(pid: int, every: bool = False) -> str:
    """Each thread of `pid` not sleeping interruptibly (`every`: each thread), with its state
    and wait channel."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return "gone"
    tasks = [(t, _task(t)) for t in tids]
    busy = [f"{t}:{task}" for t, task in tasks if every or not task.startswith("S ")]
    return f"{len(tids)} threads" + (f" [{'; '.join(busy)}]" if busy else " all S")


def _locked_mib() -> str:
    """Locked memory of the daemon and of the memservers started here, MiB: which of them
    grows while the node is short of memory (a page they fault in must come from reclaim)."""
    parts = [
        f"{name} {_memory(p).get('VmLck', 0) >> 10}"
        for name, pids in (
            ("daemon", WATCHED["daemon"]),
            ("memserver", [m.pid for m in LOCAL_MEMSERVERS if m.poll() is None]),
        )
        for p in pids
    ]
    return f" locked MiB {', '.join(parts)}" if parts else ""


def monitor(stop: threading.Event, ports: set[int], every: float = 10.0) -> None:
    """One console line every few seconds: swap traffic, free RAM, what the daemon is doing,
    its memserver connections' queues. When the guest stalls, this shows where."""
    while not stop.wait(every):
        try:
            vm, mem = vmstat(), meminfo()
            tasks = " ".join(f"daemon {_threads(p)}" for p in WATCHED["daemon"])
            tasks += _locked_mib()
            print(
                f"duvm-guest: monitor {_uptime():.0f}s out {vm.get('pswpout')} in "
                f"{vm.get('pswpin')} free {mem.get('MemFree')}k mlocked "
                f"{mem.get('Mlocked')}k {tasks} {tcp_queues(ports)}",
                flush=True,
            )
        except Exception as exc:  # the monitor must never take the run down
            print(f"duvm-guest: monitor error {exc}", flush=True)


def lock_self() -> None:
    """Keep this reporter in RAM so it can still report while everything else is swapped, and
    out of the OOM killer's reach: a workload past the node's RAM may be OOM-killed (a clean
    outcome the run reports), the script that reports it must not be."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlockall(1 | 2 | 4)  # MCL_CURRENT | MCL_FUTURE | MCL_ONFAULT
    Path("/proc/self/oom_score_adj").write_text("-1000")


def _ordinary_self() -> None:
    """A workload's preexec: it is as the OOM killer finds any program (this script, its
    parent, is out of its reach: `lock_self`), from before its first allocation."""
    Path("/proc/self/oom_score_adj").write_text("0")


def run_workload(mib: int, cgroup_mib: int | None) -> dict[str, Any]:
    """Fill `mib` MiB (swaps out), look at the swapped-out state, then verify (swaps in).

    With `cgroup_mib` the workload runs in a memory cgroup limited to that many MiB, so only
    it is under memory pressure; without, it is simply bigger than the guest's RAM."""
    t = time.monotonic()
    cmd = [
        sys.executable,
        "-m",
        "duvm.cli.workload",
        "--mib",
        str(mib),
        "--hold",
        "--progress",
        "--order",
        os.environ.get("DUVM_ORDER") or "sequential",
        "--chunk-kib",
        os.environ.get("DUVM_CHUNK_KIB") or "1024",
        "--passes",
        os.environ.get("DUVM_PASSES") or "1",
    ]
    pipes: dict[str, Any] = {
        "stdin": subprocess.PIPE,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
    }
    if cgroup_mib is None:
        return _drive(subprocess.Popen(cmd, preexec_fn=_ordinary_self, **pipes), t)
    from duvm.base.cgroup import MemoryCgroup

    with MemoryCgroup(cgroup_mib << 20, prefix="duvm-qemu") as group:
        out = _drive(group.popen(cmd, preexec_fn=_ordinary_self, **pipes), t)
        out["cgroup"] = {
            "version": group.version,
            "limit_mib": cgroup_mib,
            "peak_bytes": group.peak_bytes(),
        }
        return out


# A user's own program, not duvm's: MiB blocks of os.urandom held in a list, each checked by
# SHA-256 twice. No cgroup: it competes with everything else in the guest for RAM.
URANDOM_WORKLOAD = """
import hashlib, json, os, sys, time
n = int(sys.argv[1]); t = time.monotonic()
blocks = [os.urandom(1 << 20) for _ in range(n)]
sums = [hashlib.sha256(b).digest() for b in blocks]
print("progress fill", n, n, file=sys.stderr, flush=True)
fill = time.monotonic() - t
bad = sum(hashlib.sha256(b).digest() != s for _ in range(2) for b, s in zip(blocks, sums))
print(json.dumps({"mib": n, "bad_chunks": bad, "intact": bad == 0, "fill_s": round(fill, 2),
                  "verify_s": round(time.monotonic() - t - fill, 2)}))
"""


def run_urandom_workload(mib: int) -> dict[str, Any]:
    """The issue's reproduction: `python3 -c` holding `mib` MiB of os.urandom, verified twice."""
    t = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", URANDOM_WORKLOAD, str(mib)],
        capture_output=True,
        text=True,
        check=False,
        preexec_fn=_ordinary_self,
    )
    lines = res.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = {"unparsed": res.stdout[-2000:]}
    return {
        "rc": res.returncode,
        "result": result,
        "seconds": round(time.monotonic() - t, 2),
        "held": False,
        "stderr": res.stderr[-2000:],
    }


def _resumed_by_supervisor(old_pid: int, t: float) -> int | None:
    """The pid of the daemon the supervisor resumed after `old_pid` died, None if none within
    240 s of `t`. From the state file (scanning every /proc/PID/cmdline could block on swap)."""
    while time.monotonic() - t < 240:
        try:
            pid = json.loads(Path(STATE_DIR, "daemon.json").read_text())["pid"]
        except (OSError, ValueError, KeyError):
            pid = None
        # (_read: a failed try's daemon may vanish between looking and reading)
        if pid and pid != old_pid and "--resume" in (_read(f"/proc/{pid}/cmdline") or ""):
            state = json.loads(_read(f"{STATE_DIR}/state.json") or "{}")
            if state.get("extra", {}).get("resumed"):
                return int(pid)
        time.sleep(0.1)
    return None


def wait_for_standby(timeout: float = 240, none_for: float = 30) -> dict[str, Any]:
    """Wait until the supervisor's standby daemon is ready (it writes standby.json then), as it
    is on a node that has been up a while: the kill then tests the takeover, not the start.
    A record that has said for `none_for` seconds that none fits ends the wait early (the
    supervisor tries again only when memory allows, which a node at full pressure does not)."""
    t = time.monotonic()
    none_since = None
    while time.monotonic() - t < timeout:
        record = json.loads(_read(f"{STATE_DIR}/standby.json") or "null")
        # ready: a pid and not "starting" (a record without a pid says why there is none)
        if record and record.get("pid") and record.get("ready", True):
            return {"ready_after_s": round(time.monotonic() - t, 2), **record}
        if record and record.get("pid") is None and record.get("none"):
            none_since = none_since or time.monotonic()
            if time.monotonic() - none_since >= none_for:
                break
        else:
            none_since = None
        time.sleep(0.2)
    said = (_read(f"{STATE_DIR}/supervisor.log") or "")[-2000:]
    record = json.loads(_read(f"{STATE_DIR}/standby.json") or "null")
    return {"ready_after_s": None, "supervisor_log": said, "record": record}


def _nbd_stat(nbd: str = "nbd0") -> list[int]:
    """/sys/block/nbdN/stat: completed reads [0] and writes [4], in flight [8] (sysfs: never
    swapped out, so it can be read while the device has no server)."""
    return [int(x) for x in (_read(f"/sys/block/{nbd}/stat") or "").split()]


def watch_the_gap(t_kill: float, out: dict[str, Any], stop: threading.Event) -> None:
    """From the kill on (`t_kill`, the guest's monotonic clock), sample the device every 10 ms:
    when the first request completed after the kill, how many were in flight at it, and when
    the device first had none in flight (every request held across the crash answered)."""
    first = _nbd_stat()
    if len(first) < 9:
        return
    out["in_flight_at_kill"] = first[8]
    done0 = first[0] + first[4]
    while not stop.is_set() and time.monotonic() - t_kill < 180:
        st = _nbd_stat()
        now = round(time.monotonic() - t_kill, 3)
        if "first_completion_s" not in out and st[0] + st[4] != done0:
            out["first_completion_s"] = now
        out["max_in_flight"] = max(out.get("max_in_flight", 0), st[8])
        if "drained_s" not in out and st[8] == 0:
            out["drained_s"] = now
        if "first_completion_s" in out and "drained_s" in out:
            return
        time.sleep(0.01)


def kill_in_flight(pid: int, timeout: float = 5.0, want: int = 16) -> tuple[int, float]:
    """SIGKILL `pid` once the device has `want` requests in flight (waiting up to `timeout` s,
    then at the most seen), so the kill leaves some unanswered (issue 48: their wait is what is
    measured): how many there were, and the time of the kill. The daemon runs realtime on the
    guest's one vCPU and answers before a normal task looks, so this thread looks, and kills,
    at a higher realtime priority (SCHED_FIFO 50), sleeping 0.5 ms between looks."""
    old = os.sched_getscheduler(0), os.sched_getparam(0)
    with contextlib.suppress(OSError):
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    try:
        t = time.monotonic()
        best = 0
        while time.monotonic() - t < timeout:
            st = _nbd_stat()
            n = st[8] if len(st) > 8 else 0
            if n >= want:
                break
            best = max(best, n)
            time.sleep(0.0005)
        else:
            # not that many within the time: kill at the next look with as many as were seen
            while time.monotonic() - t < 2 * timeout:
                st = _nbd_stat()
                n = st[8] if len(st) > 8 else 0
                if n >= max(1, best):
                    break
                time.sleep(0.0005)
        at = time.monotonic()
        os.kill(pid, 9)
        return n, at
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, old[0], old[1])


def request_timer_experiment(io_timeout_ms: int, nbd: str = "nbd0") -> dict[str, Any]:
    """D48's item 6 with another check interval than the supervisor's (which sets the same
    from its start): the driver's request timeout set to 0 (a live daemon's connection is
    never cut; a request is requeued at its timer only when its socket was replaced) and the
    block queue's own timer to `io_timeout_ms`."""
    from duvm.wire import nbdnetlink as nl

    with nl.GenlSocket() as sock:
        family = sock.family_id(nl.NBD_GENL_FAMILY_NAME)
        sock.request(
            family,
            nl.NBD_CMD_RECONFIGURE,
            nl.nla_u32(nl.NBD_ATTR_INDEX, int(nbd[3:])) + nl.nla_u64(nl.NBD_ATTR_TIMEOUT, 0),
            version=nl.NBD_GENL_VERSION,
            what="NBD_CMD_RECONFIGURE timeout 0",
        )
    Path(f"/sys/block/{nbd}/queue/io_timeout").write_text(str(io_timeout_ms))
    return {"io_timeout_ms": int(Path(f"/sys/block/{nbd}/queue/io_timeout").read_text())}


def kill_and_resume(workload: subprocess.Popen[str]) -> None:
    """SIGKILL the daemon in the middle of the workload: the supervisor `duvm enable` started
    must hand the live /dev/nbd0 to its standby (or restart the daemon when none is ready), the
    new daemon serve every page the dead one had; a `duvm enable --resume` by hand afterwards
    must find nothing to do.

    The workload goes on running (issue 48): it keeps allocating while the device has no
    server, as a real program would, and the device's counters (sysfs) say how long the
    requests held across the crash waited (`watch_the_gap`). With DUVM_KILL_STOP_WORKLOAD=1 it
    is stopped (SIGSTOP) from just before the kill until the new daemon serves: what that
    variant checks that this one cannot is the resume itself on a slow emulator, where a
    workload left running can meet the OOM killer before a new daemon has started."""
    old_pid = json.loads(Path(STATE_DIR, "daemon.json").read_text())["pid"]
    supervisors = _pids_with("duvm.cli\0supervise")  # read while the daemon serves
    stopped = os.environ.get("DUVM_KILL_STOP_WORKLOAD") == "1"
    before = vmstat()
    gap: dict[str, Any] = {}
    done = threading.Event()
    restarted = threading.Event()
    if stopped:
        workload.send_signal(signal.SIGSTOP)
    try:
        gap["in_flight_before_kill"], t = kill_in_flight(old_pid)
        sampler = threading.Thread(target=watch_the_gap, args=(t, gap, done), daemon=True)
        sampler.start()
        while Path(f"/proc/{old_pid}").exists() and time.monotonic() - t < 30:
            time.sleep(0.01)
        emit(
            "killed",
            pid=old_pid,
            uptime_at_kill=round(_uptime() - (time.monotonic() - t), 2),
            stopped_workload=stopped,
            vmstat=before,
            workload_state=_task(workload.pid),
            nbd_pid=(_read("/sys/block/nbd0/pid") or "").strip() or None,
            state_files=sorted(os.listdir(STATE_DIR + "/daemon-state")),
        )
        at_kill = meminfo()
        for sup in supervisors:
            threading.Thread(
                target=watch_the_restart, args=(sup, t, restarted), daemon=True
            ).start()
        new_pid = _resumed_by_supervisor(old_pid, t)
    finally:
        restarted.set()
        if stopped:
            workload.send_signal(signal.SIGCONT)
    resumed_after = round(time.monotonic() - t, 2)
    sampler.join(180)
    done.set()
    # taken before the resume by hand below, which can take longer than the rest of the
    # workload's swapping out (Python starting under TCG)
    at_resume = vmstat()
    by_hand = duvm("enable", "--resume", "--state-dir", STATE_DIR, timeout=240)
    watch_daemon()
    new = WATCHED["daemon"]
    emit(
        "resumed",
        new_pid=new_pid,
        seconds=resumed_after,
        gap=gap,
        by_hand=by_hand,
        supervisor_log=(_read(STATE_DIR + "/supervisor.log") or "")[-3000:],
        supervisor=json.loads(_read(STATE_DIR + "/supervisor.json") or "null"),
        vmstat=vmstat(),
        vmstat_at_resume=at_resume,
        proc_swaps=_read("/proc/swaps"),
        nbd_pid=(_read("/sys/block/nbd0/pid") or "").strip() or None,
        new_daemon_pids=new,
        new_daemon_cmdline=[(_read(f"/proc/{p}/cmdline") or "").replace("\0", " ") for p in new],
        new_daemon_memory=[_memory(p) for p in new],
        new_daemon_log=logs()["daemon"],  # forked or started, and what it read from disk
        meminfo_at_kill=at_kill,
        state=json.loads(Path(STATE_DIR, "state.json").read_text()),
    )


def guard_check(nbd: str = "nbd0", timeout: float = 30.0) -> dict[str, Any]:
    """The supervisor SIGKILLed alone (after the workload): the daemon holds its request-timer
    guard (`duvm.wire.nbdguard`) and must put the driver's timeout back, which the block queue's
    `io_timeout` shows (the supervisor's quick requeue had it at 250 ms). The real netlink
    request and the real /sys/block/nbdN/pid check."""
    knob = f"/sys/block/{nbd}/queue/io_timeout"
    before = (_read(knob) or "").strip()
    daemon = (status() or {}).get("daemon") or {}
    out: dict[str, Any] = {"io_timeout_before": before, "guard_before": daemon.get("timer_guard")}
    sups = _pids_with("duvm.cli\0supervise")
    t = time.monotonic()
    for pid in sups:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while (_read(knob) or "").strip() == before and time.monotonic() - t < timeout:
        time.sleep(0.05)
    out["restored_after_s"] = round(time.monotonic() - t, 2)
    out["io_timeout_after"] = (_read(knob) or "").strip()
    out["killed"] = sups
    # the queue's timer goes back first; the guard has fired once the driver's follows
    # (`nbdguard.set_back`: once the requests in flight have drained)
    guard = None
    while time.monotonic() - t < timeout + 45:  # the restore waits up to 30 s for a drain
        guard = ((status() or {}).get("daemon") or {}).get("timer_guard")
        if guard and guard.get("fired"):
            break
        time.sleep(0.2)
    out["guard_after"] = guard
    return out


def _drive(proc: subprocess.Popen[str], t: float) -> dict[str, Any]:
    assert proc.stdin and proc.stdout and proc.stderr
    held: dict[str, Any] = {}
    last_shown = -1
    kill_at = int(os.environ.get("DUVM_KILL_AT_PCT") or -1)  # of the fill phase
    # SIGKILL the last in-guest memserver at this % of the fill
    kill_memserver_at = int(os.environ.get("DUVM_KILL_LOCAL_MEMSERVER_AT_PCT") or -1)
    killer: threading.Thread | None = None
    for line in proc.stderr:
        parts = line.split()
        if parts[:1] == ["progress"] and len(parts) == 4:
            pct = int(parts[2]) * 100 // max(1, int(parts[3]))
            if (
                parts[1] == "fill"
                and 0 <= kill_memserver_at <= pct
                and LOCAL_MEMSERVERS
                and LOCAL_MEMSERVERS[-1].poll() is None
            ):
                LOCAL_MEMSERVERS[-1].kill()  # a node's RAM lost mid-run: its pages with it
                emit("memserver_killed", pct=pct)
            if killer is None and parts[1] == "fill" and 0 <= kill_at <= pct:
                # a thread: this loop must keep draining the workload's progress pipe
                killer = threading.Thread(target=_guarded(kill_and_resume, proc), daemon=True)
                killer.start()
            if pct // 25 != last_shown:
                last_shown = pct // 25
                print(f"duvm-guest: workload {parts[1]} {pct}% at {_uptime()} s", flush=True)
            continue
        if line.strip() == "filled":
            held = {
                "fill_seconds": round(time.monotonic() - t, 2),
                "vmstat": vmstat(),
                "meminfo": meminfo(),
                "proc_swaps": _read("/proc/swaps"),
                "status": status(),
            }
            emit("filled", **held)
            try:
                proc.stdin.write("\n")
                proc.stdin.flush()
            except BrokenPipeError:  # it ended after saying so (OOM-killed): its rc tells
                pass
            last_shown = -1
        else:
            print(f"duvm-guest: workload says: {line.rstrip()}", flush=True)
    out = proc.stdout.read()
    rc = proc.wait()
    if killer is not None:
        killer.join(300)
    lines = out.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except ValueError:
        result = {"unparsed": out[-2000:]}
    return {
        "rc": rc,
        "result": result,
        "seconds": round(time.monotonic() - t, 2),
        "held": bool(held),
    }


def _guarded(fn: Any, *args: Any) -> Any:
    def run() -> None:
        try:
            fn(*args)
        except Exception as exc:  # reported, never silent: the host test judges
            emit("crash", error=f"{fn.__name__}: {type(exc).__name__}: {exc}")

    return run


def memserver_pages(peers: str) -> list[dict[str, Any]]:
    """What each memserver holds now (STATUS over the page protocol); None where unknown."""
    import asyncio

    from duvm.store.memserver_status import query_status
    from duvm.wire import auth

    secret = os.environ.get("DUVM_SECRET_FILE")
    security = auth.PeerSecurity(auth.Keyring.from_file(secret)) if secret else None
    out = []
    for peer in peers.split(","):
        host, _, port = peer.partition("://")[2 if "://" in peer else 0].rpartition(":")
        try:
            st = asyncio.run(query_status(host, int(port), timeout=10, security=security))
            out.append(
                {
                    "peer": peer,
                    "used_pages": st.get("used_pages"),
                    "reserved_pages": st.get("reserved_pages"),
                }
            )
        except Exception as exc:
            out.append({"peer": peer, "used_pages": None, "error": str(exc)})
    return out


LOCAL_MEMSERVERS: list[subprocess.Popen[bytes]] = []  # started here, the last one killable


def start_local_memservers(n: int, capacity: str) -> str:
    """Memservers inside the guest, on loopback (no QEMU network on the page path); with
    DUVM_RDMA on the guest's address with `--rdma on` and the cluster secret, named
    `rdma://` (rxe0 carries the pages: the RC traffic is rxe0 to itself)."""
    rdma = bool(os.environ.get("DUVM_RDMA"))
    host = os.environ.get("DUVM_GUEST_IP", "10.0.2.15") if rdma else "127.0.0.1"
    extra = ["--rdma", "on", "--secret-file", os.environ["DUVM_SECRET_FILE"]] if rdma else []
    peers = []
    for i in range(n):
        log = Path(f"/run/memserver{i}.log")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "duvm.cli",
                    "memserver",
                    "--listen",
                    f"{host}:0",
                    "--capacity",
                    capacity,
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # it stands in for another machine's RAM: the guest's OOM killer must not pick it
        Path(f"/proc/{proc.pid}/oom_score_adj").write_text("-1000")
        LOCAL_MEMSERVERS.append(proc)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            text = log.read_text()
            if "listening on " in text:
                addr = text.split("listening on ", 1)[1].split()[0]
                peers.append(f"rdma://{addr}" if rdma else addr)
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"in-guest memserver {i} did not start: {log.read_text()}")
    return ",".join(peers)


def run_workloads(mib: int, cgroup_mib: int | None, peers: str) -> dict[str, Any]:
    """The workload DUVM_RUNS times against the same swap device (a long-lived daemon), each
    run reported with what the device and the memservers held after it; the last run's
    result."""
    runs = int(os.environ.get("DUVM_RUNS") or "1")
    work: dict[str, Any] = {}
    for i in range(1, runs + 1):
        before = vmstat()
        work = (
            run_urandom_workload(mib)
            if os.environ.get("DUVM_URANDOM_WORKLOAD")
            else run_workload(mib, cgroup_mib)
        )
        if runs > 1:
            after = vmstat()
            time.sleep(2)  # the kernel's discards of the freed swap slots go out
            emit(
                f"run{i}",
                seconds=work["seconds"],
                result=work["result"],
                pages_out=after["pswpout"] - before["pswpout"],
                pages_in=after["pswpin"] - before["pswpin"],
                proc_swaps=_read("/proc/swaps"),
                memservers=memserver_pages(peers) if peers else [],
                status=status() if peers else None,
            )
    return work


def swap_without_discard(device: str) -> None:
    """Swap on `device` again without --discard (the experiment behind --swap-no-discard):
    freed swap slots are then never trimmed, so their pages stay on the memservers."""
    line = next(x for x in Path("/proc/swaps").read_text().splitlines() if x.startswith(device))
    priority = line.split()[-1]
    subprocess.run(["swapoff", device], check=True)
    subprocess.run(["swapon", "-p", priority, device], check=True)
    emit("swap-without-discard", proc_swaps=_read("/proc/swaps"))


NBDKIT_SOCKET = "/run/nbdkit.sock"


def nbdkit_baseline(mib: int, cgroup_mib: int | None) -> int:
    """The same swap path with nbdkit in duvm's place: `nbdkit nbd` in the guest relays the
    kernel's requests to `nbdkit memory` on the host (DUVM_NBDKIT_ADDR), the way the daemon
    relays them to memservers there, attached and swapped on by the same `attach` call as
    `duvm enable` (kernel nbd, same priority, same discard)."""
    from duvm.node.attach import attach

    host, _, port = os.environ["DUVM_NBDKIT_ADDR"].rpartition(":")
    relay = subprocess.Popen(
        [
            "nbdkit",
            *("-f", "--exit-with-parent", "-U", NBDKIT_SOCKET),
            *("nbd", f"hostname={host}", f"port={port}"),
        ]
    )
    deadline = time.monotonic() + 60
    while not os.path.exists(NBDKIT_SOCKET):
        if relay.poll() is not None or time.monotonic() > deadline:
            emit("enable", rc=1, error="nbdkit did not start")
            return 1
        time.sleep(0.1)
    state = Path(STATE_DIR) / "nbdkit-attach.json"
    os.makedirs(STATE_DIR, exist_ok=True)
    t = time.monotonic()
    attach.attach(NBDKIT_SOCKET, state, method="kernel-nbd")
    emit("enable", rc=0, seconds=round(time.monotonic() - t, 2), target="nbdkit")
    try:
        emit("attached", **device_facts(), vmstat=vmstat(), meminfo=meminfo())
        work = run_workloads(mib, cgroup_mib, "")
        emit("workload", **work, vmstat=vmstat(), proc_swaps=_read("/proc/swaps"))
    finally:
        t = time.monotonic()
        attach.detach(state, force=True)
        emit("disable", rc=0, seconds=round(time.monotonic() - t, 2))
        relay.terminate()
        relay.wait(30)
    emit("detached", **device_facts())
    return 0


def main() -> int:
    os.chdir("/run")
    lock_self()
    stop = threading.Event()
    if os.environ.get("DUVM_NBDKIT_ADDR"):
        mib = int(os.environ["DUVM_MIB"])
        cgroup = os.environ.get("DUVM_CGROUP_MIB")
        emit("start", kernel=os.uname().release, vmstat=vmstat(), workload_mib=mib, peers="")
        return nbdkit_baseline(mib, int(cgroup) if cgroup else None)
    if os.environ.get("DUVM_RDMA"):  # Soft-RoCE on the guest's NIC, before any memserver
        link = subprocess.run(
            ["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", "eth0"],
            capture_output=True,
            text=True,
            check=False,
        )
        emit("rdma_link", rc=link.returncode, out=link.stdout + link.stderr)
    peers = os.environ.get("DUVM_PEERS") or start_local_memservers(
        int(os.environ["DUVM_LOCAL_MEMSERVERS"]), os.environ["DUVM_CAPACITY"]
    )
    ports = {int(p.rpartition(":")[2]) for p in peers.split(",")}
    threading.Thread(target=monitor, args=(stop, ports), daemon=True).start()
    size = os.environ["DUVM_SIZE"]
    mib = int(os.environ["DUVM_MIB"])
    cgroup_mib = int(os.environ["DUVM_CGROUP_MIB"]) if os.environ.get("DUVM_CGROUP_MIB") else None
    mem_total = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    emit(
        "start",
        kernel=os.uname().release,
        mem_total_kb=mem_total,
        vmstat=vmstat(),
        meminfo=meminfo(),
        min_free_kbytes=int(Path("/proc/sys/vm/min_free_kbytes").read_text()),
        watermark_boost_factor=int(Path("/proc/sys/vm/watermark_boost_factor").read_text()),
        has_dev_nbd0=os.path.exists("/dev/nbd0"),
        workload_mib=mib,
        peers=peers,
        size=size,
    )
    # a config file as a user would write one; -v makes the daemon log why a connection ends
    config = Path("/run/duvm-test.toml")
    # memservers on the host are off the guest's loopback: a test network, no secret, and
    # no page encryption (AES without AES-NI under TCG would dominate the run)
    daemon_args = (
        ["-v"]
        + (["--insecure", "--no-encrypt"] if os.environ.get("DUVM_PEERS") else [])
        + os.environ.get("DUVM_DAEMON_ARGS", "").split()
    )
    workers = int(os.environ.get("DUVM_WORKERS") or 1)
    config.write_text(
        f'peers = {json.dumps(peers.split(","))}\nsize = "{size}"\n'
        f'method = "{os.environ.get("DUVM_METHOD") or "kernel-nbd"}"\nstate_dir = "{STATE_DIR}"\n'
        f"daemon_args = {json.dumps(daemon_args)}\nworkers = {workers}\n"
    )
    secret = os.environ.get("DUVM_SECRET_FILE")
    if secret:  # exactly what a user types: the defaults, the cluster secret, nothing else
        enable = duvm("enable", "--peers", peers, "--size", size, "--secret-file", secret)
    else:
        enable = duvm("enable", "--config", str(config))
    emit("enable", **enable)
    watch_daemon()
    if enable["rc"] != 0:
        return 1
    disabled = False
    try:
        emit("attached", **device_facts(), vmstat=vmstat(), meminfo=meminfo())
        if workers > 1:
            emit("workers", **worker_facts())
        if os.environ.get("DUVM_SWAP_NO_DISCARD"):
            swap_without_discard("/dev/nbd0")
        if os.environ.get("DUVM_KILL_AT_PCT"):
            # a daemon of several workers has no standby: its record says so at once
            emit("standby", **wait_for_standby(none_for=30 if workers == 1 else 2))
        if os.environ.get("DUVM_NBD_IO_TIMEOUT_MS"):
            emit(
                "request_timer",
                **request_timer_experiment(int(os.environ["DUVM_NBD_IO_TIMEOUT_MS"])),
            )
        work = run_workloads(mib, cgroup_mib, peers)
        if workers > 1:
            emit("workers_after", **worker_facts())
        emit(
            "workload",
            **work,
            vmstat=vmstat(),
            proc_swaps=_read("/proc/swaps"),
            logs=logs(),
            meminfo=meminfo(),
        )
        if os.environ.get("DUVM_KILL_AT_PCT"):
            # while the supervisor still watches: its connection handed again after a cut
            emit("cut", **guest_cut.cut_check(STATE_DIR))
            # a second crash, with the standby gone: the supervisor forks a new daemon
            emit("fork", **guest_fork.fork_check(STATE_DIR))
            emit("guard", **guard_check())
        emit("disable", **duvm("disable", "--state-dir", STATE_DIR))
        disabled = True
        emit(
            "detached",
            **device_facts(),
            memservers=memserver_pages(peers),
            supervisor_left=os.path.exists(f"{STATE_DIR}/supervisor.json"),
        )
    finally:
        if not disabled:  # a failure above: still leave the guest clean (and say so)
            emit("cleanup", **duvm("disable", "--force", "--state-dir", STATE_DIR), logs=logs())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # the host must see why, not just a silent power-off
        emit("crash", error=f"{type(exc).__name__}: {exc}")
        raise
