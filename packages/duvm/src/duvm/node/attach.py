"""Turn the local daemon's NBD export into an active swap device, and back. Root only.

Theory of operation
-------------------
The daemon is an NBD server on a Unix socket. The kernel needs a block device:

* **kernel nbd** (production): ``/dev/nbdN``, tried first, after ``modprobe nbd`` when the
  module is not loaded. Connected over generic netlink (:mod:`duvm.wire.nbdnetlink`:
  ``NBD_CMD_CONNECT`` with a dead-connection timeout, so a restarted daemon can take the live
  device back with ``NBD_CMD_RECONFIGURE``, see :func:`reattach_kernel`); on a kernel whose
  nbd has no netlink family, by the ioctl holder process of :mod:`duvm.node.kernelnbd` instead.
* **nbdfuse + loop** (fallback where the kernel has no nbd): ``nbdfuse`` (libnbd) shows the
  export as one file on a FUSE mount; ``losetup --direct-io=on`` puts a loop device on that file,
  so swap I/O goes straight to nbdfuse without a second copy in the page cache.

Then ``mkswap`` and ``swapon -p PRIORITY --discard=pages``: discard makes the kernel trim swap
slots as it frees them, which reaches the daemon as NBD_CMD_TRIM and frees remote pages. After
``swapoff``, ``blkdiscard`` trims the whole device (the swap header and anything left), so the
pool holds 0 pages of ours once detached.

Swapping over a network block device needs memory on the I/O path (socket buffers, FUSE
requests). If free memory runs out, the kernel cannot allocate for the request that would free
memory, and the machine freezes. ``vm.min_free_kbytes`` is the reserve the allocator keeps for
such atomic/reclaim allocations; see :func:`safe_min_free_kbytes` for the floor we set. It is
raised (never lowered) on attach and restored on detach if nobody changed it meanwhile.

Every step is recorded in a small JSON state file (written atomically after each step), so
``detach`` — also after a crash half-way through ``attach`` — knows exactly what to undo.
Detach order is the reverse of attach, and ``swapoff`` comes first: if the kernel cannot bring
the swapped pages home (not enough free RAM), nothing else is torn down and the error says so.

System tools are called by absolute path (found in the standard sbin/bin directories, never via
$PATH), and each missing tool is reported with the Debian package that provides it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from duvm.base import cgroup, pressure
from duvm.node import kernelnbd
from duvm.wire import nbdnetlink

DEFAULT_RUN_DIR = Path("/run/duvm")
DEFAULT_PRIORITY = 100  # above distribution swap (negative priorities): the pool is tried first
DEFAULT_NBD_TIMEOUT_S = 60
# How long the kernel holds requests for a restarted daemon after the connection died. The
# memservers keep a dead daemon's namespace for their lease (60 s by default); after that the
# pages are gone anyway, so waiting longer would only stall the swapping programs longer.
DEFAULT_DEAD_CONN_TIMEOUT_S = 60
MIN_FREE_SYSCTL = Path("/proc/sys/vm/min_free_kbytes")

_TOOL_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# tool -> Debian package (bookworm; trixie splits nbdfuse into its own package)
TOOL_PACKAGES = {
    "nbdfuse": "libnbd-bin (Debian 12) or nbdfuse (Debian 13+)",
    "fusermount3": "fuse3",
    "losetup": "mount",
    "mkswap": "util-linux",
    "swapon": "util-linux",
    "swapoff": "util-linux",
    "blkdiscard": "util-linux",
    "modprobe": "kmod",
}

Saver = Callable[[], None]

METHOD_KERNEL = "kernel-nbd"
METHOD_FUSE = "nbdfuse-loop"


class AttachError(Exception):
    """Attaching or detaching cannot proceed; the message says why and what to do."""


class SwapoffFailed(AttachError):
    """swapoff refused; the device stays attached."""


# --- small helpers ---------------------------------------------------------------------------


def find_tool(name: str, dirs: tuple[str, ...] | None = None) -> str | None:
    """The executable `name` in the system directories (never $PATH: this runs as root)."""
    for d in _TOOL_DIRS if dirs is None else dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        raise AttachError(f"{name} not found; install the Debian package {TOOL_PACKAGES[name]}")
    return path


def require_root() -> None:
    if os.geteuid() != 0:
        raise AttachError("attaching swap needs root (loop/nbd devices, swapon): run with sudo")


def _run(tool: str, *args: str, timeout: float = 120) -> str:
    cmd = [require_tool(tool), *args]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise AttachError(f"{' '.join(cmd)} did not finish in {timeout:.0f} s") from exc
    if res.returncode != 0:
        msg = (res.stderr or res.stdout).strip()
        raise AttachError(f"{' '.join(cmd)} failed (exit {res.returncode}): {msg}")
    return res.stdout


# Children this process started and has not reaped: polling their Popen reaps them cleanly.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def spawn_detached(
    cmd: list[str], log: Path, preexec: Callable[[], object] | None = None
) -> subprocess.Popen[bytes]:
    """Start a long-lived helper in its own session, so it outlives `duvm enable`; `preexec`
    runs in the child before the program starts."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
            preexec_fn=preexec,
        )
    _CHILDREN[proc.pid] = proc
    return proc


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; reaps it first if it is our own exited child."""
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is None:
            return True
        del _CHILDREN[pid]
        return False
    with contextlib.suppress(ChildProcessError, OSError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait_pid_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return not pid_alive(pid)


def _pid_runs(pid: int | None, name: str) -> bool:
    """`pid` is alive and is still the program we started (guards against PID reuse)."""
    if pid is None or not pid_alive(pid):
        return False
    try:
        return name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def duvm_runs(pid: int, subcommand: str) -> bool:
    """`pid` is alive and is `duvm SUBCOMMAND` (python -m duvm.cli), not a recycled PID."""
    if not pid_alive(pid):
        return False
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"duvm.cli" in cmd and subcommand.encode() in cmd


# --- vm.min_free_kbytes ----------------------------------------------------------------------


def safe_min_free_kbytes(mem_total_kb: int) -> int:
    """The reserve we want while swapping over the network, in KiB.

    The kernel's own default is ``sqrt(16 * lowmem_kb)``: 1447 KiB in a 192 MiB guest, where
    swap over NBD froze 4 of 6 runs; 8192 KiB (5.6x the default, 4.2 % of RAM) froze none of 12.
    We take 4x the kernel formula, never below that measured 8192 KiB, and cap it at the
    kernel's own upper bound for the default (262144 KiB), so the reserve grows with the square
    root of RAM: 192 MiB -> 8192, 1 GiB -> 16384, 16 GiB -> 65536, 24 GiB -> ~79500,
    >= 256 GiB -> 262144.
    """
    return int(min(262144, max(8192, 4 * math.sqrt(16 * max(mem_total_kb, 0)))))


def mem_total_kb(meminfo: str | None = None) -> int:
    text = meminfo if meminfo is not None else Path("/proc/meminfo").read_text()
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1])
    raise AttachError("MemTotal missing from /proc/meminfo")


def raise_min_free(sysctl: Path = MIN_FREE_SYSCTL) -> tuple[int, int | None]:
    """Raise to the safe floor if lower. Returns (value before, value we set or None)."""
    before = int(sysctl.read_text())
    floor = safe_min_free_kbytes(mem_total_kb())
    if before >= floor:
        return before, None
    sysctl.write_text(str(floor))
    return before, floor


def restore_min_free(
    before: int | None, we_set: int | None, sysctl: Path = MIN_FREE_SYSCTL
) -> None:
    """Put back the old value, unless someone changed it after we did (then theirs stands)."""
    if before is None or we_set is None:
        return
    if int(sysctl.read_text()) == we_set:
        sysctl.write_text(str(before))


# --- /proc/swaps -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SwapEntry:
    filename: str
    type: str
    size_kb: int
    used_kb: int
    priority: int


def parse_proc_swaps(text: str) -> list[SwapEntry]:
    """Lines of /proc/swaps -> entries. Malformed lines are skipped, never fatal."""
    out = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) != 5:
            continue
        name, kind, size, used, prio = parts
        try:
            out.append(SwapEntry(name.replace("\\040", " "), kind, int(size), int(used), int(prio)))
        except ValueError:
            continue
    return out


def swap_entry(device: str) -> SwapEntry | None:
    real = os.path.realpath(device)
    for e in parse_proc_swaps(Path("/proc/swaps").read_text()):
        if e.filename in (device, real):
            return e
    return None


# --- state -----------------------------------------------------------------------------------


@dataclass
class Attachment:
    """What is attached, step by step; persisted so detach can undo exactly that."""

    socket: str
    method: str
    priority: int = DEFAULT_PRIORITY
    size_bytes: int | None = None
    device: str | None = None  # the block device that is (or will be) the swap device
    swap_active: bool = False
    nbd_device: str | None = None
    holder_pid: int | None = None
    nbd_netlink: bool = False  # connected over netlink (no holder; can be reconfigured)
    dead_conn_timeout_s: int | None = None
    mountdir: str | None = None
    fuse_file: str | None = None
    nbdfuse_pid: int | None = None
    loop_device: str | None = None
    direct_io: bool | None = None
    min_free_before: int | None = None
    min_free_set: int | None = None
    extra: dict[str, object] = field(default_factory=dict)  # for the control layer (daemon pid)


def save_state(path: Path, att: Attachment) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(att), indent=2) + "\n")
    os.replace(tmp, path)


def load_state(path: Path) -> Attachment | None:
    """The recorded attachment, or None when there is none. A corrupt file is an error."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AttachError(f"state file {path} is unreadable ({exc}); inspect it by hand") from exc
    if not isinstance(raw, dict) or "socket" not in raw or "method" not in raw:
        raise AttachError(f"state file {path} is not a duvm attachment; inspect it by hand")
    known = {f.name for f in fields(Attachment)}
    return Attachment(**{k: v for k, v in raw.items() if k in known})


# --- the two device paths --------------------------------------------------------------------


def kernel_nbd_available() -> bool:
    if kernelnbd.kernel_has_nbd():
        return True
    modprobe = find_tool("modprobe")
    if modprobe is None:
        return False
    subprocess.run([modprobe, "nbd"], capture_output=True, check=False, timeout=30)
    return kernelnbd.kernel_has_nbd()


def fuse_path_problems() -> list[str]:
    """Why the nbdfuse+loop path cannot work here (empty list: it can)."""
    problems = [
        f"{t} missing (Debian package {TOOL_PACKAGES[t]})"
        for t in ("nbdfuse", "fusermount3", "losetup")
        if find_tool(t) is None
    ]
    if not Path("/dev/fuse").exists():
        problems.append("/dev/fuse missing (kernel without FUSE; try modprobe fuse)")
    if not Path("/dev/loop-control").exists():
        problems.append("/dev/loop-control missing (kernel without loop; try modprobe loop)")
    return problems


def _attach_kernel(att: Attachment, run_dir: Path, timeout_s: int, save: Saver) -> None:
    device = kernelnbd.free_device()
    if device is None:
        raise AttachError("every /dev/nbdN is in use (load nbd with a higher nbds_max)")
    att.nbd_device = device
    if nbdnetlink.available():
        _attach_netlink(att, device, timeout_s, save)
        return
    logpath = run_dir / f"holder-{Path(device).name}.log"
    proc = spawn_detached(kernelnbd.holder_command(device, att.socket, timeout_s), logpath)
    att.holder_pid = proc.pid
    save()
    deadline = time.monotonic() + 30
    while not kernelnbd.device_started(device):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = logpath.read_text()[-800:]
            raise AttachError(f"kernel nbd attach of {device} failed: {tail.strip()}")
        time.sleep(0.05)
    att.device = device
    att.size_bytes = int(Path("/sys/block", Path(device).name, "size").read_text()) * 512
    att.extra["nbd_pid"] = _nbd_pid(device)


def _nbd_pid(device: str) -> str | None:
    """/sys/block/nbdN/pid: set when the device is connected, kept across a reconfigure, so
    it tells our connection from someone else's on the same device number."""
    try:
        return Path("/sys/block", Path(device).name, "pid").read_text().strip() or None
    except OSError:
        return None


def _handshake(socket_path: str) -> tuple[socket.socket, kernelnbd.NegotiatedExport]:
    try:
        return kernelnbd.connect_unix(socket_path)
    except (OSError, kernelnbd.NbdHandshakeError) as exc:
        raise AttachError(f"NBD handshake with the daemon at {socket_path} failed: {exc}") from exc


def _attach_netlink(att: Attachment, device: str, timeout_s: int, save: Saver) -> None:
    """NBD_CMD_CONNECT: the kernel takes its own reference on the socket, so nothing of
    ours has to stay running; the dead-connection timeout lets a new daemon take over."""
    sock, info = _handshake(att.socket)
    att.nbd_netlink = True
    att.dead_conn_timeout_s = DEFAULT_DEAD_CONN_TIMEOUT_S
    save()  # from here a failure must disconnect the device
    try:
        nbdnetlink.connect(
            device,
            [sock.fileno()],
            info.size,
            server_flags=info.transmission_flags,
            timeout_s=timeout_s,
            dead_conn_timeout_s=DEFAULT_DEAD_CONN_TIMEOUT_S,
        )
    except OSError as exc:
        raise AttachError(f"kernel nbd attach of {device} over netlink failed: {exc}") from exc
    finally:
        sock.close()
    deadline = time.monotonic() + 30
    while not kernelnbd.device_started(device):
        if time.monotonic() > deadline:
            raise AttachError(f"{device} did not start after NBD_CMD_CONNECT")
        time.sleep(0.05)
    att.device = device
    att.size_bytes = int(Path("/sys/block", Path(device).name, "size").read_text()) * 512
    att.extra["nbd_pid"] = _nbd_pid(device)


def reattach_kernel(att: Attachment) -> None:
    """Hand the (restarted) daemon's socket to the live device whose connection died:
    NBD_CMD_RECONFIGURE. The kernel then resends every request the dead daemon left
    unanswered, and swap continues where it stopped."""
    require_root()
    if att.method != METHOD_KERNEL or not att.nbd_netlink or not att.nbd_device:
        raise AttachError(
            "only a kernel nbd device attached over netlink can be handed to a "
            "restarted daemon (this one is "
            f"{att.method}{'' if att.nbd_netlink else ' via ioctls'})"
        )
    if not kernelnbd.device_started(att.nbd_device):
        raise AttachError(
            f"{att.nbd_device} is no longer connected (the dead-connection "
            f"timeout of {att.dead_conn_timeout_s} s passed?); its swapped pages "
            "are gone: `duvm disable --force`, then enable again"
        )
    sock, _info = _handshake(att.socket)
    try:
        nbdnetlink.reconfigure(att.nbd_device, [sock.fileno()])
    except OSError as exc:
        raise AttachError(
            f"handing the daemon's new connection to {att.nbd_device} failed: {exc}"
        ) from exc
    finally:
        sock.close()


def _attach_fuse(att: Attachment, run_dir: Path, save: Saver, realtime: bool = True) -> None:
    nbdfuse = require_tool("nbdfuse")
    require_tool("fusermount3")
    mountdir = run_dir.resolve() / f"fuse-{uuid.uuid4().hex[:8]}"  # as the kernel names it
    mountdir.mkdir(parents=True)
    att.mountdir = str(mountdir)
    att.fuse_file = str(mountdir / "swap")
    save()
    pidfile = run_dir / f"{mountdir.name}.pid"
    logpath = run_dir / f"{mountdir.name}.log"
    # nbdfuse is on the swap path like the daemon: realtime and an I/O flusher from its first
    # instruction (both survive exec; mlockall does not, so it cannot be locked from here)
    proc = spawn_detached(
        [nbdfuse, "-P", str(pidfile), att.fuse_file, "--unix", att.socket],
        logpath,
        preexec=pressure.inherited_protections if realtime else pressure.become_io_flusher,
    )
    att.nbdfuse_pid = proc.pid
    save()
    # nbdfuse sits on the swap path: if the OOM killer picked it, every swapped page would be
    # unreachable and the processes owning them would die on swap-in errors
    with contextlib.suppress(OSError):
        Path(f"/proc/{proc.pid}/oom_score_adj").write_text("-1000")
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not os.path.exists(att.fuse_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AttachError(
                f"nbdfuse could not expose {att.socket}: {logpath.read_text()[-800:].strip()}"
            )
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)
    att.size_bytes = os.stat(att.fuse_file).st_size
    loop = _run("losetup", "--find", "--show", "--direct-io=on", att.fuse_file).strip()
    att.loop_device = loop
    save()
    dio = Path("/sys/block", Path(loop).name, "loop", "dio")
    att.direct_io = dio.exists() and dio.read_text().strip() == "1"
    att.device = loop


# --- public API ------------------------------------------------------------------------------


def attach(
    socket_path: str,
    state_path: Path,
    *,
    run_dir: Path = DEFAULT_RUN_DIR,
    method: str = "auto",
    priority: int = DEFAULT_PRIORITY,
    nbd_timeout_s: int = DEFAULT_NBD_TIMEOUT_S,
    extra: dict[str, object] | None = None,
    realtime: bool = True,
) -> Attachment:
    """Attach the NBD export at `socket_path` and activate it as swap. Root only.

    `method` is "auto" (kernel nbd when present, else nbdfuse+loop), METHOD_KERNEL or
    METHOD_FUSE. `realtime` runs nbdfuse at SCHED_RR like the daemon (duvm.base.pressure). On
    failure everything done so far is undone and AttachError raised.
    """
    require_root()
    for tool in ("mkswap", "swapon", "swapoff", "blkdiscard"):
        require_tool(tool)
    existing = load_state(state_path)
    if existing is not None:
        raise AttachError(
            f"already attached ({existing.device or existing.method}, state in "
            f"{state_path}); detach first"
        )
    if method == "auto":
        if kernel_nbd_available():
            method = METHOD_KERNEL
        else:
            problems = fuse_path_problems()
            if problems:
                raise AttachError(
                    "no way to attach: the kernel has no nbd module, and the "
                    "nbdfuse fallback cannot run: " + "; ".join(problems)
                )
            method = METHOD_FUSE
    elif method == METHOD_KERNEL and not kernel_nbd_available():
        raise AttachError("the kernel has no nbd driver (modprobe nbd failed or kmod missing)")
    elif method == METHOD_FUSE and (problems := fuse_path_problems()):
        raise AttachError("nbdfuse fallback cannot run: " + "; ".join(problems))
    elif method not in (METHOD_KERNEL, METHOD_FUSE):
        raise AttachError(f"unknown attach method {method!r}")
    if not os.path.exists(socket_path):
        raise AttachError(f"no NBD server socket at {socket_path} (is the daemon running?)")

    run_dir.mkdir(parents=True, exist_ok=True)
    att = Attachment(socket=socket_path, method=method, priority=priority, extra=extra or {})

    def save() -> None:
        save_state(state_path, att)

    save()
    try:
        att.min_free_before, att.min_free_set = raise_min_free()
        save()
        if method == METHOD_KERNEL:
            _attach_kernel(att, run_dir, nbd_timeout_s, save)
        else:
            _attach_fuse(att, run_dir, save, realtime)
        save()
        assert att.device is not None
        _run("mkswap", att.device)
        _run("swapon", "-p", str(priority), "--discard=pages", att.device)
        att.swap_active = True
        save()
    except BaseException as exc:
        try:
            detach(state_path, force=True)  # only just activated: nothing to protect yet
        except AttachError as undo:
            raise AttachError(f"{exc}; undoing the partial attach also failed: {undo}") from exc
        raise
    return att


def swapoff_problems(entry: SwapEntry) -> list[str]:
    """Reasons swapoff of `entry` would fail or make the kernel kill processes (empty: none).

    The cgroup check cannot tell which swap device a group's pages are on, so it is
    conservative; it is skipped when nothing is on our device.
    """
    problems: list[str] = []
    if entry.used_kb == 0:
        return problems
    available = mem_available_kb()
    if available is not None and entry.used_kb > available:
        problems.append(
            f"{entry.used_kb >> 10} MiB are swapped out to {entry.filename} but only "
            f"{available >> 10} MiB of RAM are available to bring them home"
        )
    problems += cgroup.swap_headroom_problems()
    return problems


def mem_available_kb() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return None


def detach(state_path: Path, *, force: bool = False) -> Attachment | None:
    """Undo what the state file records: swapoff first, then the device, then the sysctl.

    Returns the attachment that was removed, or None when nothing was attached. Raises
    SwapoffFailed (device still attached, state kept) when the kernel cannot take the pages
    back, or — unless `force` — when a check shows it could not without killing processes.
    """
    require_root()
    att = load_state(state_path)
    if att is None:
        return None
    entry = swap_entry(att.device) if att.device else None
    problem = device_problem(att)
    if problem is not None:
        # Someone detached it behind our back and the number was reused: swapoff or discard
        # would hit their device. Leave it alone; what is still ours is cleaned up below.
        entry = None
        att.extra["device_problem"] = problem
    if entry is not None:
        problems = [] if force else swapoff_problems(entry)
        if problems:
            raise SwapoffFailed(
                f"not turning off swap on {att.device}: the kernel would have to bring every "
                f"swapped page back into RAM, and there is no room: "
                + "; ".join(problems)
                + ". It stays attached and nothing was lost. Free memory (stop or resize those "
                "workloads) and run disable again (--force skips this check; swapoff itself "
                "still refuses when RAM is short, and the kernel may OOM-kill such a group)."
            )
        try:
            _run("swapoff", att.device, timeout=3600)
        except AttachError as exc:
            raise SwapoffFailed(swapoff_failure(att.device, str(exc))) from exc
    att.swap_active = False
    save_state(state_path, att)
    errors: list[str] = []
    if entry is not None and att.device:
        # swapoff leaves the swap header and stale slots on the device; discard them all so the
        # pool's RAM is given back even before the daemon releases its reservation
        # (not fatal: stopping the daemon releases the reservation anyway)
        try:
            _run("blkdiscard", "-f", att.device, timeout=600)
        except AttachError as exc:
            att.extra["discard_error"] = str(exc)
    if att.method == METHOD_KERNEL:
        _detach_kernel(att, errors)
    else:
        _detach_fuse(att, errors)
    try:
        restore_min_free(att.min_free_before, att.min_free_set)
    except (OSError, ValueError) as exc:
        errors.append(f"could not restore vm.min_free_kbytes={att.min_free_before}: {exc}")
    if errors:
        save_state(state_path, att)
        raise AttachError("detach incomplete: " + "; ".join(errors))
    state_path.unlink(missing_ok=True)
    return att


def swapoff_failure(device: str, error: str) -> str:
    """What a failed swapoff means, from what it said: RAM too short, or pages unreadable."""
    if "Input/output error" in error or "EIO" in error:
        why = (
            "the kernel could not read some swapped pages back from it (I/O errors: is the "
            "daemon running and are its memservers reachable? `duvm status` shows both). "
            "Pages it did read are back in RAM; fix the cause and run disable again"
        )
    else:
        why = (
            "the kernel must bring every swapped page back into RAM first; this usually "
            "means there is not enough free memory (and a memory-limited cgroup that could "
            "not take its pages back may have been OOM-killed). Free memory and run disable "
            "again"
        )
    return f"swapoff of {device} failed, so it stays attached: {why}. ({error})"


def device_problem(att: Attachment) -> str | None:
    """Why `att.device` is no longer the device this attachment made, or None. Device numbers
    are reused as soon as they are free: a loop device must still be backed by our FUSE file,
    and a connected nbd device must still carry the connection pid seen at attach."""
    if not att.device:
        return None
    if att.method == METHOD_KERNEL:
        recorded, now = att.extra.get("nbd_pid"), _nbd_pid(att.device)
        if recorded and now and now != recorded:  # (not connected at all: still ours to clean)
            return (
                f"{att.device} is connected by someone else now (pid {now}, duvm's "
                f"connection was pid {recorded})"
            )
        return None
    if att.device != att.loop_device:
        return None
    found = _loop_backing(att.device)
    if found is None:
        return f"{att.device} is no longer a loop device"
    if not _same_path(found, att.fuse_file):
        return f"{att.device} is now backed by {found}, not by duvm's {att.fuse_file}"
    return None


def _loop_backing(device: str) -> str | None:
    try:
        return Path("/sys/block", Path(device).name, "loop", "backing_file").read_text().strip()
    except OSError:
        return None


def _same_path(kernel_path: str, ours: str | None) -> bool:
    """The kernel reports a loop device's backing file resolved; ours may name it through a
    symlink or a relative state directory."""
    return ours is not None and os.path.realpath(kernel_path) == os.path.realpath(ours)


def _detach_kernel(att: Attachment, errors: list[str]) -> None:
    if att.nbd_netlink:
        if att.nbd_device and kernelnbd.device_started(att.nbd_device):
            try:
                nbdnetlink.disconnect(att.nbd_device)
            except OSError as exc:
                errors.append(f"NBD_CMD_DISCONNECT on {att.nbd_device}: {exc}")
                return
            deadline = time.monotonic() + 30
            while kernelnbd.device_started(att.nbd_device):
                if time.monotonic() > deadline:
                    errors.append(f"{att.nbd_device} still connected 30 s after disconnect")
                    return
                time.sleep(0.05)
        return
    if att.nbd_device and kernelnbd.device_started(att.nbd_device):
        try:
            kernelnbd.disconnect(att.nbd_device)
        except OSError as exc:
            errors.append(f"NBD_DISCONNECT on {att.nbd_device}: {exc}")
    if (
        att.holder_pid
        and _pid_runs(att.holder_pid, "duvm.node.kernelnbd")
        and not wait_pid_exit(att.holder_pid, 30)
    ):
        errors.append(f"nbd holder {att.holder_pid} still runs after disconnect")
        return
    att.holder_pid = None


def _detach_fuse(att: Attachment, errors: list[str]) -> None:
    if att.loop_device:
        found = _loop_backing(att.loop_device)
        if found is not None and _same_path(found, att.fuse_file):
            try:
                _run("losetup", "-d", att.loop_device)
            except AttachError as exc:
                errors.append(str(exc))
                return
        att.loop_device = None
    if att.mountdir and _is_mounted(att.mountdir):
        # the loop driver drops its file reference asynchronously after losetup -d
        for attempt in range(50):
            try:
                _run("fusermount3", "-u", att.mountdir)
                break
            except AttachError as exc:
                if attempt == 49:
                    errors.append(str(exc))
                    return
                time.sleep(0.1)
    if (
        att.nbdfuse_pid
        and _pid_runs(att.nbdfuse_pid, "nbdfuse")
        and not wait_pid_exit(att.nbdfuse_pid, 30)
    ):
        errors.append(f"nbdfuse {att.nbdfuse_pid} still runs after unmount")
        return
    att.nbdfuse_pid = None
    if att.mountdir:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(att.mountdir)
        run_dir = Path(att.mountdir).parent
        with contextlib.suppress(FileNotFoundError):
            (run_dir / f"{Path(att.mountdir).name}.log").unlink()


def _is_mounted(path: str) -> bool:
    real = os.path.realpath(path)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 1 and parts[1].replace("\\040", " ") == real:
            return True
    return False
