"""The kernel nbd path of `duvm.node.attach.attach`: the daemon's export as ``/dev/nbdN``.

``modprobe nbd`` first when the module is not loaded. The device is connected over generic
netlink (:mod:`duvm.wire.nbdnetlink`: ``NBD_CMD_CONNECT`` with a dead-connection timeout, so a
restarted daemon can take the live device back with ``NBD_CMD_RECONFIGURE``, see
:func:`reattach`); on a kernel whose nbd has no netlink family, by the ioctl holder process of
:mod:`duvm.node.attach.kernelnbd` instead. Detach disconnects the device the way it was connected.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from duvm.node.attach import kernelnbd, processes, systools
from duvm.node.attach.attach_state import METHOD_KERNEL, AttachError, Attachment, Saver
from duvm.node.attach.systools import SYSTEM_TOOLS, Tools
from duvm.wire import nbdnetlink
from duvm.wire.nbdguard import nbd_pid, set_back  # nbd_pid: the one reader of its sysfs file

# How long the kernel holds requests for a restarted daemon after the connection died. The
# memservers keep a dead daemon's namespace for their lease (60 s by default); after that the
# pages are gone anyway, so waiting longer would only stall the swapping programs longer.
DEFAULT_DEAD_CONN_TIMEOUT_S = 60


def available(tools: Tools = SYSTEM_TOOLS) -> bool:
    """The kernel has nbd, loading the module first when it is not loaded."""
    if kernelnbd.kernel_has_nbd():
        return True
    modprobe = tools.find("modprobe")
    if modprobe is None:
        return False
    subprocess.run([modprobe, "nbd"], capture_output=True, check=False, timeout=30)
    return kernelnbd.kernel_has_nbd()


def attach(att: Attachment, run_dir: Path, timeout_s: int, save: Saver) -> None:
    """Connect a free /dev/nbdN to the daemon's socket; `att.device` is set once it runs."""
    device = kernelnbd.free_device()
    if device is None:
        raise AttachError("every /dev/nbdN is in use (load nbd with a higher nbds_max)")
    att.nbd_device = device
    if nbdnetlink.available():
        _attach_netlink(att, device, timeout_s, save)
        return
    if att.connections != 1:
        raise AttachError(
            f"{att.connections} connections to one device need the nbd driver's netlink "
            "interface, which this kernel does not offer"
        )
    logpath = run_dir / f"holder-{Path(device).name}.log"
    proc = processes.spawn_detached(
        kernelnbd.holder_command(device, att.socket, timeout_s), logpath
    )
    att.holder_pid, att.holder_start = proc.pid, processes.start_time(proc.pid)
    save()
    deadline = time.monotonic() + 30
    while not kernelnbd.device_started(device):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = logpath.read_text()[-800:]
            raise AttachError(f"kernel nbd attach of {device} failed: {tail.strip()}")
        time.sleep(0.05)
    att.device = device
    att.size_bytes = int(Path("/sys/block", Path(device).name, "size").read_text()) * 512
    att.extra["nbd_pid"] = nbd_pid(device)
    att.extra["wbt_lat_usec_before"] = no_writeback_throttle(device)


def no_writeback_throttle(device: str, sys_root: Path = Path("/sys")) -> str:
    """Turn the block layer's writeback throttling off on `device` (`queue/wbt_lat_usec` 0).
    Requests held across a daemon's crash stay in flight until the kernel's request timer
    resends them (60 s, DECISIONS.md D48); writeback throttling counts them, so reclaim (kswapd
    and every task short of memory) waited in `wbt_wait` for that long although the device was
    served again within a second (kernel stacks, QEMU guest, docs/BENCHMARKS.md "A daemon
    crash"). What was there before, or why it could not be set."""
    knob = sys_root / "block" / Path(device).name / "queue" / "wbt_lat_usec"
    try:
        before = knob.read_text().strip()
        knob.write_text("0")
    except OSError as exc:
        return f"not set ({exc.strerror or exc})"
    return before


# While a supervisor watches the daemon, the block queue's timer looks at each request in flight
# this long after it started, and again as long after each look (`queue/io_timeout`, ms; the
# block layer arms its timer about a second later than asked, `blk_round_jiffies`): a request
# still waiting on a connection that was replaced since it was sent (a takeover) is resent
# then, instead of after the driver's 60 s (D48). 1000 ms made some wait 2.3 s.
REQUEUE_CHECK_MS = 250


class RequestTimer:
    """How the kernel times the device's requests in flight (kernel nbd over netlink).

    `quick_requeue`: the driver's timeout 0, so its timer never cuts a live daemon's connection
    (it only logs "Possible stuck request" each check) and requeues a request whose connection
    was replaced since it was sent; the queue's own timer `REQUEUE_CHECK_MS`. Nothing in the
    kernel then ends the requests of a dead connection that nobody replaces: the supervisor that
    arms this owes them a takeover, or the disconnect of giving up, and `restore` on its way
    out. `restore`: the driver's timeout back to `timeout_s` (the block queue's follows), in
    an order that cuts no live connection (`duvm.wire.nbdguard.set_back`).
    Each returns None when done, else why not (the device is not ours, or the kernel refused)."""

    def __init__(
        self,
        *,
        set_timeout: Callable[[str, int], None] = nbdnetlink.set_timeout,
        sys_root: Path = Path("/sys"),
        wait: Callable[[float], None] = time.sleep,
    ) -> None:
        self._set_timeout = set_timeout
        self._sys_root = sys_root
        self._wait = wait

    def _ours(self, att: Attachment) -> str | None:
        if att.method != METHOD_KERNEL or not att.nbd_netlink or not att.nbd_device:
            return "not a kernel nbd device attached over netlink"
        recorded = att.extra.get("nbd_pid")
        if not recorded or nbd_pid(att.nbd_device, self._sys_root) != recorded:
            return f"{att.nbd_device} is not connected by duvm's connection"
        return None

    def quick_requeue(self, att: Attachment, check_ms: int = REQUEUE_CHECK_MS) -> str | None:
        if why := self._ours(att):
            return why
        assert att.nbd_device is not None
        knob = self._sys_root / "block" / Path(att.nbd_device).name / "queue" / "io_timeout"
        try:
            self._set_timeout(att.nbd_device, 0)
            knob.write_text(str(check_ms))
        except OSError as exc:
            return f"{exc.strerror or exc}"
        return None

    def restore(self, att: Attachment, timeout_s: int, *, live: bool = True) -> str | None:
        """`live`: a daemon still serves the connection, which the restore must not cut
        (`nbdguard.set_back`: it waits for the requests in flight to drain); without one (a
        crash) it is immediate."""
        if why := self._ours(att):
            return why
        assert att.nbd_device is not None
        try:
            if live:
                set_back(
                    att.nbd_device,
                    timeout_s,
                    set_timeout=self._set_timeout,
                    sys_root=self._sys_root,
                    wait=self._wait,
                )
            else:
                self._set_timeout(att.nbd_device, timeout_s)
        except OSError as exc:
            return f"{exc.strerror or exc}"
        return None


def _handshake(socket_path: str) -> tuple[socket.socket, kernelnbd.NegotiatedExport]:
    try:
        return kernelnbd.connect_unix(socket_path)
    except (OSError, kernelnbd.NbdHandshakeError) as exc:
        raise AttachError(f"NBD handshake with the daemon at {socket_path} failed: {exc}") from exc


def _handshakes(socket_path: str, n: int) -> tuple[list[socket.socket], kernelnbd.NegotiatedExport]:
    """`n` connections to the daemon, each through its handshake (a daemon with workers hands
    them out in turn, one per worker)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock, info = _handshake(socket_path)
            socks.append(sock)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks, info


def _attach_netlink(att: Attachment, device: str, timeout_s: int, save: Saver) -> None:
    """NBD_CMD_CONNECT: the kernel takes its own reference on the socket, so nothing of
    ours has to stay running; the dead-connection timeout lets a new daemon take over."""
    socks, info = _handshakes(att.socket, att.connections)
    att.nbd_netlink = True
    att.dead_conn_timeout_s = DEFAULT_DEAD_CONN_TIMEOUT_S
    save()  # from here a failure must disconnect the device
    try:
        nbdnetlink.connect(
            device,
            [s.fileno() for s in socks],
            info.size,
            server_flags=info.transmission_flags,
            timeout_s=timeout_s,
            dead_conn_timeout_s=DEFAULT_DEAD_CONN_TIMEOUT_S,
        )
    except OSError as exc:
        raise AttachError(f"kernel nbd attach of {device} over netlink failed: {exc}") from exc
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 30
    while not kernelnbd.device_started(device):
        if time.monotonic() > deadline:
            raise AttachError(f"{device} did not start after NBD_CMD_CONNECT")
        time.sleep(0.05)
    att.device = device
    att.size_bytes = int(Path("/sys/block", Path(device).name, "size").read_text()) * 512
    att.extra["nbd_pid"] = nbd_pid(device)
    att.extra["wbt_lat_usec_before"] = no_writeback_throttle(device)


def reattach(att: Attachment, socket_path: str | None = None) -> None:
    """Hand the (restarted) daemon's socket to the live device whose connection died:
    NBD_CMD_RECONFIGURE. The kernel then resends every request the dead daemon left
    unanswered, and swap continues where it stopped. `socket_path`: where that daemon listens
    when not at `att.socket` (a standby, before it takes the daemon's name)."""
    systools.require_root()
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
    socks, _info = _handshakes(socket_path or att.socket, att.connections)
    try:
        nbdnetlink.reconfigure(att.nbd_device, [s.fileno() for s in socks])
    except OSError as exc:
        raise AttachError(
            f"handing the daemon's new connection to {att.nbd_device} failed: {exc}"
        ) from exc
    finally:
        for s in socks:
            s.close()


def device_problem(att: Attachment, sys_root: Path = Path("/sys")) -> str | None:
    """Why the connected `att.device` is no longer ours, or None: the number is reused as soon
    as it is free, so a connected device must still carry the connection pid seen at attach
    (read under `sys_root`, where sysfs is mounted)."""
    assert att.device is not None
    recorded, now = att.extra.get("nbd_pid"), nbd_pid(att.device, sys_root)
    if recorded and now and now != recorded:  # (not connected at all: still ours to clean)
        return (
            f"{att.device} is connected by someone else now (pid {now}, duvm's "
            f"connection was pid {recorded})"
        )
    return None


def detach(att: Attachment, errors: list[str]) -> None:
    """Disconnect the device the way it was connected; what failed is appended to `errors`."""
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
        and processes.pid_runs(att.holder_pid, "duvm.node.attach.kernelnbd", att.holder_start)
        and not processes.wait_pid_exit(att.holder_pid, 30, att.holder_start)
    ):
        errors.append(f"nbd holder {att.holder_pid} still runs after disconnect")
        return
    att.holder_pid = att.holder_start = None
