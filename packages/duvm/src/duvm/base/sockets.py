"""Socket options shared by every TCP and Unix connection on the data path: the daemon's
connections to memservers, the memserver's accepted ones, and the NBD server's.

Large forced buffers let one send take a whole frame or reply batch; TCP keepalive and
TCP_USER_TIMEOUT detect a dead peer without per-request timers.
"""

from __future__ import annotations

import contextlib
import platform
import socket
import sys

SOCKET_BUFFER = 4 << 20  # bytes; holds a whole max-size frame in flight
USER_TIMEOUT_MS = 15000  # unacknowledged data this long -> the connection is dead


# CPython does not export SO_SNDBUFFORCE/SO_RCVBUFFORCE; these are their numbers in Linux's
# asm-generic/socket.h, which these architectures use (mips, sparc, parisc and alpha number
# them differently: there only the plain options are tried).
_GENERIC_SOCKET_H = (
    "x86_64",
    "i686",
    "i386",
    "aarch64",
    "armv7l",
    "armv6l",
    "riscv64",
    "ppc64le",
    "ppc64",
    "s390x",
    "loongarch64",
)
_SNDBUFFORCE, _RCVBUFFORCE = (
    (getattr(socket, "SO_SNDBUFFORCE", 32), getattr(socket, "SO_RCVBUFFORCE", 33))
    if sys.platform == "linux" and platform.machine() in _GENERIC_SOCKET_H
    else (None, None)
)


def set_buffers(sock: socket.socket, size: int) -> None:
    """Send and receive buffers of `size` bytes, so that one send takes a whole frame or reply
    batch. SO_*BUFFORCE (root) goes past net.core.[rw]mem_max (212992 bytes on a stock
    kernel); without that privilege the plain option is capped there, which still works, with
    more sends per large frame. Options a socket does not take are skipped."""
    for force, plain in ((_SNDBUFFORCE, socket.SO_SNDBUF), (_RCVBUFFORCE, socket.SO_RCVBUF)):
        for opt in (force, plain):
            if opt is None:
                continue
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
                break
            except OSError:
                continue


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay on small frames, buffers for whole large frames, dead-peer detection."""
    set_buffers(sock, SOCKET_BUFFER)
    opts = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    ]
    for name, value in (
        ("TCP_KEEPIDLE", 5),
        ("TCP_KEEPINTVL", 2),
        ("TCP_KEEPCNT", 3),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        # not TCP (a Unix socket) or not permitted: the defaults still work
        with contextlib.suppress(OSError):
            sock.setsockopt(level, opt, value)
