"""The NBD server of the daemon: one `BlockStore` served as one NBD export on Unix and/or TCP
sockets, the driver of the `duvm.wire.nbdproto` codec.

It accepts connections (each a `duvm.node.daemon.nbdconnection.NBDConnection`, which runs the
handshake, then a `duvm.node.daemon.nbd_transmission.Transmission`, which runs the requests; its
docstring explains the request path), owns the set of open connections, offers the transmission
flags the store's capabilities allow, and on close lets in-flight requests finish and their
replies go out before the sockets close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypedDict

from duvm.node.daemon.nbdconnection import DEFAULT_HANDSHAKE_TIMEOUT, NBDConnection
from duvm.store.storage import BlockStore, Capabilities
from duvm.wire import nbdconst as C
from duvm.wire.nbdproto import ExportInfo, buffer_pool

if TYPE_CHECKING:
    from duvm.base.metrics import LatencyByKind
    from duvm.wire.nbdtrace import RequestTrace

log = logging.getLogger("duvm.nbd")


def transmission_flags(caps: Capabilities) -> int:
    """The transmission flags that a store with these capabilities supports."""
    flags = C.FLAG_HAS_FLAGS
    if not caps.can_write:
        flags |= C.FLAG_READ_ONLY
    if caps.can_flush:
        # FUA is honoured by flushing after the command, so it rides on flush support.
        flags |= C.FLAG_SEND_FLUSH | C.FLAG_SEND_FUA
    if caps.can_write and caps.can_trim:
        flags |= C.FLAG_SEND_TRIM
    if caps.can_write and caps.can_zero:
        flags |= C.FLAG_SEND_WRITE_ZEROES
    if caps.can_multi_conn:
        flags |= C.FLAG_CAN_MULTI_CONN
    return flags


class NbdCounts(TypedDict):
    """The NBD server's counters since it started (`ServerStats.as_dict`), as the status
    socket reports them under "nbd"."""

    connections: int  # accepted (refused ones included), not open now
    errors: int  # requests answered with an error
    peak_in_flight: int  # most requests of one connection inside the store at once
    protocol_errors: int  # connections dropped for breaking the protocol
    requests: int  # requests received


class ServerStats:
    """Counters for tests and the status socket. The NBD server counts connections and
    protocol errors (`NBDServer.admit`, `protocol_error`); a connection's `Transmission`
    counts its requests, errors, protocol errors and in-flight peak here on the hot path."""

    __slots__ = ("connections", "errors", "peak_in_flight", "protocol_errors", "requests")

    def __init__(self) -> None:
        self.peak_in_flight = 0
        self.connections = 0
        self.requests = 0
        self.errors = 0
        self.protocol_errors = 0

    def as_dict(self) -> NbdCounts:
        return NbdCounts(
            connections=self.connections,
            errors=self.errors,
            peak_in_flight=self.peak_in_flight,
            protocol_errors=self.protocol_errors,
            requests=self.requests,
        )


# Payload bytes a connection may have in flight before its reading pauses (the client's
# requests then wait in its socket). Each in-flight write also holds its sealed copy, so this
# bounds what slow memservers can make the daemon allocate: in a QEMU guest short of memory,
# with 64 MiB allowed, the daemon took 25 MiB of fresh pages in 10 s while its memservers
# lagged, pages that had to come from reclaim waiting on the daemon itself (docs/BENCHMARKS.md,
# "A daemon crash"). `benchmarks/swap_path_growth.py`, 256 KiB writes at QD64 with one
# memserver stopped for 4 s: the daemon grew by 32.9 MiB with 64 MiB allowed, 8.5 MiB with
# 4 MiB. 4 MiB keeps 16 requests of 256 KiB in flight; a client that keeps 64 of them in
# flight (nbdcopy) lost about 9 % of its write throughput to it (docs/BENCHMARKS.md).
MAX_IN_FLIGHT_BYTES = 4 << 20


class ConnectionSpreader(Protocol):
    """Who serves each accepted connection (`duvm.node.daemon.workers.Workers`)."""

    def take(self) -> Callable[[socket.socket], bool] | None:
        """None: this server serves the next connection; else a function that hands its socket
        to another process (False when it cannot, and this server serves it)."""
        ...


class _HandedOff(asyncio.Protocol):
    """An accepted connection that another process serves: its socket is handed over before
    anything is read from it, then closed here (the other process holds its own descriptor)."""

    def __init__(self, server: NBDServer, give: Callable[[socket.socket], bool]) -> None:
        self.server, self.give = server, give

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None and self.give(sock):
            transport.abort()  # type: ignore[attr-defined]
            return
        conn = NBDConnection(self.server)  # the other process cannot: served here
        transport.set_protocol(conn)
        conn.connection_made(transport)
        transport.resume_reading()  # type: ignore[attr-defined]


class NBDServer:
    """Serve one `BlockStore` as one NBD export on Unix and/or TCP sockets."""

    def __init__(
        self,
        store: BlockStore,
        export_name: str = "",
        *,
        description: str = "duvm",
        max_in_flight: int = 512,
        max_in_flight_bytes: int = MAX_IN_FLIGHT_BYTES,
        max_connections: int = 64,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> None:
        self.store = store
        self.export = ExportInfo(
            name=export_name,
            size=store.size,
            flags=transmission_flags(store.capabilities),
            description=description,
        )
        self.max_in_flight = max_in_flight
        self.max_in_flight_bytes = max_in_flight_bytes
        self.max_connections = max_connections  # each holds a 256 KiB receive buffer
        self.handshake_timeout = handshake_timeout  # seconds a client may take to negotiate
        self.stats = ServerStats()
        # NBD request times when the daemon runs with --metrics
        # (duvm.node.daemon.metrics.start), else None (no cost)
        self.latency: LatencyByKind | None = None
        # the request trace when the daemon runs with --trace, else None
        self.trace: RequestTrace | None = None
        self.pool = buffer_pool()
        self._servers: list[asyncio.Server] = []
        self._connections: set[NBDConnection] = set()
        self._unix_paths: list[str] = []
        self._closing = False
        # hands connections to other workers (`duvm daemon --workers`); None: all served here
        self.spreader: ConnectionSpreader | None = None

    def _protocol(self) -> asyncio.Protocol:
        give = self.spreader.take() if self.spreader is not None else None
        return NBDConnection(self) if give is None else _HandedOff(self, give)

    async def start_unix(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            if os.path.exists(path) and not _is_socket(path):
                raise FileExistsError(f"{path} exists and is not a socket")
            os.unlink(path)
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(self._protocol, path, backlog=128)
        os.chmod(path, 0o600)
        self._servers.append(server)
        self._unix_paths.append(path)

    async def start_unix_bound(self, sock: socket.socket, path: str) -> None:
        """Serve on `sock`, a Unix socket already bound to `path` and listening (a standby's,
        bound before the takeover: starting to serve then touches no file)."""
        loop = asyncio.get_running_loop()
        server = await loop.create_unix_server(self._protocol, sock=sock)
        self._servers.append(server)
        self._unix_paths.append(path)

    def renamed_unix(self, old: str, new: str) -> None:
        """The socket at `old` was given the name `new` (by another process): the one to
        remove when closing."""
        self._unix_paths = [new if p == old else p for p in self._unix_paths]

    async def start_tcp(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._protocol, host, port, backlog=128)
        self._servers.append(server)
        return server.sockets[0].getsockname()[:2]

    def admit(self, conn: NBDConnection) -> bool:
        """Count a new connection in; False (refuse it) while closing or when full."""
        self.stats.connections += 1
        if self._closing:
            return False
        if len(self._connections) >= self.max_connections:
            log.warning("refusing connection: already %d connections", self.max_connections)
            return False
        self._connections.add(conn)
        return True

    def forget(self, conn: NBDConnection) -> None:
        """A connection is gone."""
        self._connections.discard(conn)

    def time_requests(self, latency: LatencyByKind) -> None:
        """Observe each request's time into `latency` on connections opened from now on
        (--metrics, set before serving)."""
        self.latency = latency

    def protocol_error(self) -> None:
        """A connection broke the protocol (or never finished its handshake) and is dropped."""
        self.stats.protocol_errors += 1

    @property
    def open_connections(self) -> int:
        """Connections open now (`stats.connections` counts every one accepted)."""
        return len(self._connections)

    def clients_holding(self) -> int:
        """Connections whose client still holds its end, looked at on each socket itself (not
        through the event loop, which may not have seen an end of file queued a moment ago).
        A standby asks this after the supervisor gave the kernel's driver a connection to it:
        the driver drops a new connection, and still answers success, when it has not yet
        marked the dead daemon's connection dead."""
        held = 0
        for conn in list(self._connections):
            t = conn.transport
            sock = None if t is None or t.is_closing() else t.get_extra_info("socket")
            if sock is not None and _client_holds(sock.fileno()):
                held += 1
        return held

    async def close(self, timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish and reply, then close connections."""
        self._closing = True
        for s in self._servers:
            s.close()
        for path in self._unix_paths:
            with contextlib.suppress(FileNotFoundError):
                if _is_socket(path):
                    os.unlink(path)
        self._unix_paths.clear()
        for conn in list(self._connections):
            conn.shutdown()
        deadline = asyncio.get_running_loop().time() + timeout
        while self._connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self._connections):
            conn.abort("server shut down before in-flight requests finished")
        for s in self._servers:
            await s.wait_closed()
        self._servers.clear()


def _client_holds(fd: int) -> bool:
    """The peer of the connected socket `fd` has not closed its end: a peek finds data or
    nothing yet, never the end of file."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except (BlockingIOError, InterruptedError):
        return True  # open, nothing to read yet
    except OSError:
        return False
    finally:
        sock.close()


def _is_socket(path: str) -> bool:
    return stat.S_ISSOCK(os.lstat(path).st_mode)
