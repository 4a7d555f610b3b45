"""Runs inside the QEMU test guest (imported by guest_check.py): the daemon's kernel nbd
connection cut while the daemon runs, and how soon the device is served again.

Theory of operation: the 6.1 driver's receive worker of a dead connection can end after a
takeover and shut down the connection that replaced it (`duvm.node.lifecycle.linkmend`). The
same cut is made here on purpose, from outside: a copy of the daemon's end of the connection
(`pidfd_getfd`) is shut down, the driver reads end of file, marks the connection dead and
reports it (``NBD_CMD_LINK_DEAD``); the supervisor must hand the device a new connection to
the same daemon. A direct read of one block of the device measures it: served within a
moment, or only after the driver's 60 s dead-connection timeout (then failed).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

SYS_PIDFD_GETFD = 438  # x86_64 (and every architecture since 5.6's unified numbers)
SO_ACCEPTCON = 0x10000  # /proc/net/unix "Flags" of a listening socket
CONNECTED = "03"  # /proc/net/unix "St": SS_CONNECTED


def connections(pid: int, paths: tuple[str, ...]) -> list[int]:
    """Process `pid`'s file descriptors of connections accepted on a unix socket bound at one
    of `paths` (they carry its address in /proc/net/unix, the one it was bound at: a standby
    that took over listens on its own name renamed; the listener is flagged)."""
    inodes = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 8 and f[7] in paths and f[5] == CONNECTED and not int(f[3], 16) & SO_ACCEPTCON:
            inodes.add(f"socket:[{f[6]}]")
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}") in inodes:
                out.append(int(name))
        except OSError:  # closed meanwhile
            continue
    return sorted(out)


def shut_down(pid: int, fd: int) -> None:
    """Shut down the socket process `pid` holds as `fd` (both directions, both ends see it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        mine = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if mine < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd({pid}, {fd}): {os.strerror(err)}")
    finally:
        os.close(pidfd)
    sock = socket.socket(fileno=mine)
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


def timed_read(device: str, offset: int, wait_s: float) -> tuple[float | None, str | None]:
    """Read one 4 KiB block of `device` at `offset`, bypassing the page cache: (seconds it
    took, None), or (None, why) when it failed or had not returned after `wait_s`."""
    result: dict[str, Any] = {}

    def read() -> None:
        t = time.monotonic()
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
        fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
        try:
            n = os.preadv(fd, [buf], offset)
            result["s"] = time.monotonic() - t
            if n != 4096:
                result["error"] = f"short read: {n} bytes"
        except OSError as exc:
            result["error"] = f"{exc} after {time.monotonic() - t:.1f} s"
        finally:
            os.close(fd)
            buf.close()

    thread = threading.Thread(target=read, daemon=True)  # may wait the device's 60 s
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        return None, f"not served after {wait_s:g} s"
    if "error" in result:
        return None, result["error"]
    return round(result["s"], 3), None


def kernel_log_count(text: str) -> int:
    """How many records of the kernel's log (/dev/kmsg, every level, whatever the console
    shows) contain `text`."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    n = 0
    try:
        while True:
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return n
            except BrokenPipeError:  # overwritten while read: go on with the next record
                continue
            n += text.encode() in record
    finally:
        os.close(fd)


def cut_check(state_dir: str, device: str = "/dev/nbd0", wait_s: float = 30.0) -> dict[str, Any]:
    """Cut the serving daemon's connection and read the device: the facts for the host's
    test (which connection, how soon served, whether the same daemon serves and what the
    supervisor said)."""
    from duvm.base.control_socket import STANDBY_SUFFIX
    from duvm.node.lifecycle import control

    daemon = control.load_daemon(Path(state_dir))
    if daemon is None:
        return {"error": "no daemon recorded"}
    paths = (daemon.socket, daemon.socket + STANDBY_SUFFIX)
    log = Path(state_dir, "supervisor.log")

    def mended() -> list[str]:
        return [ln for ln in log.read_text().splitlines() if "connection dead while daemon" in ln]

    fds = connections(daemon.pid, paths)
    out: dict[str, Any] = {"daemon_pid": daemon.pid, "connections": fds}
    if len(fds) != 1:
        out["error"] = f"expected one connection of the device to the daemon, found {fds}"
        return out
    out["read_before_s"], out["read_before_error"] = timed_read(device, 0, wait_s)
    out["mended_before"] = len(mended())
    out["reconnected_before"] = kernel_log_count("reconnected socket")
    t = time.monotonic()
    shut_down(daemon.pid, fds[0])
    out["served_after_s"], out["read_error"] = timed_read(device, 4096, wait_s)
    out["seconds"] = round(time.monotonic() - t, 3)
    now = control.load_daemon(Path(state_dir))
    out["same_daemon"] = now is not None and now.pid == daemon.pid and control.daemon_alive(now)
    out["connections_after"] = connections(daemon.pid, paths)
    deadline = time.monotonic() + 10  # the supervisor logs through a writer thread
    while len(mended()) <= out["mended_before"] and time.monotonic() < deadline:
        time.sleep(0.1)
    out["mended"] = mended()
    out["reconnected_after"] = kernel_log_count("reconnected socket")
    return out
