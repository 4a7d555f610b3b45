"""The socket options duvm's servers and clients set: buffers that hold a whole frame (past
net.core.[rw]mem_max when running as root), no Nagle delay and dead-peer detection on TCP."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

import pytest
from duvm.base import sockets
from duvm.base.sockets import SOCKET_BUFFER, set_buffers, tune_socket
from duvm.node.daemon.nbdconnection import _tune_socket


def _cap(name: str) -> int:
    return int(Path(f"/proc/sys/net/core/{name}").read_text())


def test_buffers_go_past_the_sysctl_cap_as_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("SO_SNDBUFFORCE/SO_RCVBUFFORCE need root (CAP_NET_ADMIN)")
    want = 4 * max(_cap("wmem_max"), _cap("rmem_max"))  # plain options stop at 2x the cap
    with socket.socket() as s:
        set_buffers(s, want)
        # the kernel doubles the value for its bookkeeping; capped it would be 2 * *mem_max
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= want
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= want


def test_tcp_sockets_get_every_option_and_unix_ones_what_applies() -> None:
    with socket.socket() as tcp:
        tune_socket(tcp)
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) > 0
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(
            SOCKET_BUFFER, _cap("wmem_max")
        )
    a, b = socket.socketpair()  # Unix: no TCP options, and no error for them
    with a, b:
        tune_socket(a)
        _tune_socket(b)
        assert b.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(
            SOCKET_BUFFER, _cap("wmem_max")
        )


class _Refuses:
    """A socket that takes no option: records each setsockopt, then refuses it."""

    def __init__(self) -> None:
        self.tried: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, opt: int, value: int) -> None:
        self.tried.append((level, opt, value))
        raise OSError(errno.ENOPROTOOPT, "Protocol not available")


def test_a_socket_that_takes_nothing_is_left_as_is() -> None:
    """Catches an option refusal that escapes (a connection would fail to start on a kernel
    or socket type without that option) and a refused forced buffer size that is not retried
    with the plain option (the buffers would stay at their small defaults)."""
    s = _Refuses()
    set_buffers(s, 1 << 20)  # type: ignore[arg-type]
    sol = socket.SOL_SOCKET
    assert s.tried == [
        (sol, sockets._SNDBUFFORCE, 1 << 20),
        (sol, socket.SO_SNDBUF, 1 << 20),  # the plain option after the forced one
        (sol, sockets._RCVBUFFORCE, 1 << 20),
        (sol, socket.SO_RCVBUF, 1 << 20),
    ]
    s = _Refuses()
    tune_socket(s)  # type: ignore[arg-type]
    tried = {(level, opt) for level, opt, _ in s.tried}
    assert {(socket.IPPROTO_TCP, socket.TCP_NODELAY), (sol, socket.SO_KEEPALIVE)} <= tried
    assert (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) in tried
    closed = socket.socket()
    closed.close()
    tune_socket(closed)  # every setsockopt fails with EBADF: skipped, no exception
    assert closed.fileno() == -1
