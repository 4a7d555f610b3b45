"""The memserver's TCP server: it listens, caps connections and tracks the unauthenticated
ones; each accepted connection is a `duvm.memserver.connection.Connection` serving one
`PageStore`.

- Every connection must authenticate within `handshake_timeout` and is one of at most
  `max_handshakes` unauthenticated ones; when that many are pending the oldest is dropped, so
  a flood of idle or slow connections delays a real client by at most one handshake slot
  instead of locking it out. Authenticated connections are capped at `max_connections`.
- `idle_timeout` (off by default: a swap device may rightly be idle for hours) closes
  authenticated connections idle that long.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

from duvm.memserver.connection import Connection
from duvm.memserver.pagestore import DEFAULT_LEASE_S, PageStore, StoreUsage
from duvm.memserver.rdma_service import RdmaService
from duvm.rdma import verbs
from duvm.wire import auth
from duvm.wire.pageproto import PAGE_SIZE

if TYPE_CHECKING:
    from duvm.base.metrics import LatencyByKind

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 256  # authenticated; each holds a ~4.3 MiB receive buffer
DEFAULT_MAX_HANDSHAKES = 64  # unauthenticated; each holds ~0.5 KiB
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0

# What a connection reports to its server with `MemServer.count` (the security counters).
Event = Literal["auth_failures", "handshake_timeouts", "unauthenticated_requests"]


class MemServer:
    """A memserver listening on TCP. `await start()` binds and returns (host, port).

    `keyring`: cluster secrets; every connection must prove one (None: no secret check).
    `tls`: a server SSL context (auth.server_tls_context); when it requires client
    certificates, a verified certificate authenticates a client that has no secret.

    The server owns its set of connections, the unauthenticated ones among them, its security
    counters and its RDMA listener; a `Connection` reports to it through `connection_opened`,
    `authenticated`, `connection_closed` and `count`, and asks it for secrets (`secret_for`).
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        lock: bool = True,
        keyring: auth.Keyring | None = None,
        tls: ssl.SSLContext | None = None,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        idle_timeout: float | None = None,
    ) -> None:
        if capacity_bytes < PAGE_SIZE:
            raise ValueError(f"capacity must be at least one page ({PAGE_SIZE} bytes)")
        if max_connections < 1 or max_handshakes < 1 or handshake_timeout <= 0:
            raise ValueError("connection limits and the handshake timeout must be positive")
        self.store = PageStore(capacity_bytes // PAGE_SIZE, lease_s=lease_s, lock=lock)
        self._keyring = keyring
        self.tls = tls
        self.tls_client_auth = tls is not None and tls.verify_mode == ssl.CERT_REQUIRED
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self._conns: set[Connection] = set()
        # unauthenticated, oldest first
        self._pending: OrderedDict[Connection, None] = OrderedDict()
        self._counters = {
            "auth_failures": 0,
            "handshake_timeouts": 0,
            "handshakes_evicted": 0,
            "unauthenticated_requests": 0,
            "idle_closed": 0,
        }
        self.store.extra_status = self.server_status
        # per-frame service times when serving --metrics (duvm.memserver.metrics.start),
        # else None (no cost per frame)
        self.latency: LatencyByKind | None = None
        # the RDMA listener (start_rdma), None when this memserver serves TCP only
        self._rdma: RdmaService | None = None
        self.rdma_error: str | None = None  # why not, when RDMA was asked for
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def auth_required(self) -> bool:
        return self._keyring is not None or self.tls_client_auth

    @property
    def checks_secret(self) -> bool:
        """Whether clients must prove a cluster secret (a keyring is set)."""
        return self._keyring is not None

    def secret_for(self, key_id: bytes) -> bytes | None:
        """The accepted secret named by `key_id`; None when unknown or without a keyring."""
        return self._keyring.lookup(key_id) if self._keyring is not None else None

    @property
    def rdma(self) -> RdmaService | None:
        """The RDMA listener, None when this memserver serves TCP only."""
        return self._rdma

    @property
    def counters(self) -> Mapping[str, int]:
        """The security and connection-limit counters (read-only)."""
        return MappingProxyType(self._counters)

    def count(self, event: Event) -> None:
        """A connection saw `event` (a failed proof, an expired handshake, a request before
        authentication)."""
        self._counters[event] += 1

    def time_requests(self, latency: LatencyByKind) -> None:
        """Observe each frame's service time into `latency` from now on (--metrics)."""
        self.latency = latency

    def usage(self) -> StoreUsage:
        """The page store's use and counters (metrics)."""
        return self.store.usage()

    def local_status(self) -> dict[str, Any]:
        """What the local control socket answers: the STATUS document, marked as a
        memserver's (`duvm.base.control_socket`; gputaskman's system panel reads it)."""
        return {"role": "memserver", **self.store.status()}

    def open_connections(self) -> list[Connection]:
        """The connections open now, authenticated or not (a copy)."""
        return list(self._conns)

    def pending_connections(self) -> list[Connection]:
        """The unauthenticated connections, oldest first (a copy)."""
        return list(self._pending)

    def server_status(self) -> dict:
        """The server's own fields of STATUS: security and RDMA."""
        rdma = self._rdma.status() if self._rdma is not None else {"listening": False}
        if self.rdma_error:
            rdma["error"] = self.rdma_error
        return {"security": self.security_status(), "rdma": rdma}

    def security_status(self) -> dict:
        return {
            "auth": "secret" if self._keyring else "tls" if self.tls_client_auth else "none",
            "tls": self.tls is not None,
            "max_connections": self.max_connections,
            "pending_handshakes": len(self._pending),
            **self._counters,
        }

    def set_keyring(self, keyring: auth.Keyring | None) -> None:
        """Swap the accepted secrets (SIGHUP after a rotation step); live connections stay."""
        self._keyring = keyring

    def connection_opened(self, conn: Connection) -> None:
        """A new connection, unauthenticated; when the handshake slots are full, the oldest
        unauthenticated one is dropped."""
        self._conns.add(conn)
        while len(self._pending) >= self.max_handshakes:
            old, _ = self._pending.popitem(last=False)
            self._counters["handshakes_evicted"] += 1
            log.warning(
                "dropping unauthenticated connection from %s: %d handshakes pending",
                old.peer,
                self.max_handshakes,
            )
            old.evict()
        self._pending[conn] = None

    def authenticated(self, conn: Connection) -> bool:
        """`conn` proved itself: count it among the authenticated connections, or False
        (refuse it) when `max_connections` are already authenticated."""
        if sum(1 for c in self._conns if c.authed) >= self.max_connections:
            return False
        self._pending.pop(conn, None)
        return True

    def connection_closed(self, conn: Connection) -> None:
        """`conn` is gone: forget it, and drop its RDMA regions before its namespace can go."""
        self._conns.discard(conn)
        self._pending.pop(conn, None)
        if self._rdma is not None:
            self._rdma.closed(conn)

    def _sweep(self) -> None:
        """Close authenticated connections idle longer than idle_timeout (when set)."""
        assert self.idle_timeout is not None
        cutoff = time.monotonic() - self.idle_timeout
        for c in list(self._conns):
            if c.close_if_idle(cutoff):
                log.info("closing idle connection from %s", c.peer)
                self._counters["idle_closed"] += 1
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(max(0.05, self.idle_timeout / 4), self._sweep)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: Connection(self),
            host,
            port,
            reuse_address=True,
            backlog=128,
            ssl=self.tls,
            ssl_handshake_timeout=self.handshake_timeout if self.tls else None,
        )
        if self.idle_timeout is not None:
            self._sweeper = loop.call_later(max(0.05, self.idle_timeout / 4), self._sweep)
        addr = self._server.sockets[0].getsockname()
        return addr[0], addr[1]

    def start_rdma(
        self,
        host: str,
        port: int,
        *,
        required: bool,
        load_verbs: Callable[[], verbs.VerbsApi | None] = verbs.load,
    ) -> bool:
        """Listen with rdma-cm on `host`:`port` beside TCP. True when listening; otherwise
        `rdma_error` says why, and OSError is raised when `required`. `load_verbs` gives the
        verbs module (tests: a fake device, duvm.testing.fake_verbs)."""
        v = load_verbs()
        try:
            if v is None:
                raise OSError(f"the RDMA transport is not built ({verbs.state()})")
            service = RdmaService(self.store, v)
            service.start(host, port)
        except OSError as e:
            self.rdma_error = str(e)
            if required:
                raise
            return False
        self._rdma = service
        return True

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for conn in list(self._conns):
                conn.abort()
            await self._server.wait_closed()
            self._server = None
        await asyncio.sleep(0)  # let connection_lost callbacks run before the arena goes
        if self._rdma is not None:
            self._rdma.close()  # every region before the arena it covers
            self._rdma = None
        self.store.close()
