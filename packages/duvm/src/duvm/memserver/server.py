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
from typing import Any

from duvm.memserver.connection import Connection
from duvm.memserver.pagestore import DEFAULT_LEASE_S, PageStore
from duvm.memserver.rdma_service import RdmaService
from duvm.rdma import verbs
from duvm.wire import auth
from duvm.wire.pageproto import PAGE_SIZE

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 256  # authenticated; each holds a ~4.3 MiB receive buffer
DEFAULT_MAX_HANDSHAKES = 64  # unauthenticated; each holds ~0.5 KiB
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0


class MemServer:
    """A memserver listening on TCP. `await start()` binds and returns (host, port).

    `keyring`: cluster secrets; every connection must prove one (None: no secret check).
    `tls`: a server SSL context (auth.server_tls_context); when it requires client
    certificates, a verified certificate authenticates a client that has no secret.
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
        self.keyring = keyring
        self.tls = tls
        self.tls_client_auth = tls is not None and tls.verify_mode == ssl.CERT_REQUIRED
        self.max_connections = max_connections
        self.max_handshakes = max_handshakes
        self.handshake_timeout = handshake_timeout
        self.idle_timeout = idle_timeout
        self.conns: set[Connection] = set()
        self.pending: OrderedDict[Connection, None] = OrderedDict()  # unauthenticated, oldest first
        self.counters = {
            "auth_failures": 0,
            "handshake_timeouts": 0,
            "handshakes_evicted": 0,
            "unauthenticated_requests": 0,
            "idle_closed": 0,
        }
        self.store.extra_status = self.server_status
        # duvm.wire.metrics.LatencyByKind when serving --metrics, else None (no cost per frame)
        self.latency: Any = None
        # the RDMA listener (start_rdma), None when this memserver serves TCP only
        self.rdma: RdmaService | None = None
        self.rdma_error: str | None = None  # why not, when RDMA was asked for
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def auth_required(self) -> bool:
        return self.keyring is not None or self.tls_client_auth

    def server_status(self) -> dict:
        """The server's own fields of STATUS: security and RDMA."""
        rdma = self.rdma.status() if self.rdma is not None else {"listening": False}
        if self.rdma_error:
            rdma["error"] = self.rdma_error
        return {"security": self.security_status(), "rdma": rdma}

    def security_status(self) -> dict:
        return {
            "auth": "secret" if self.keyring else "tls" if self.tls_client_auth else "none",
            "tls": self.tls is not None,
            "max_connections": self.max_connections,
            "pending_handshakes": len(self.pending),
            **self.counters,
        }

    def set_keyring(self, keyring: auth.Keyring | None) -> None:
        """Swap the accepted secrets (SIGHUP after a rotation step); live connections stay."""
        self.keyring = keyring

    def add_pending(self, conn: Connection) -> None:
        """A new unauthenticated connection; when the slots are full, drop the oldest one."""
        while len(self.pending) >= self.max_handshakes:
            old, _ = self.pending.popitem(last=False)
            self.counters["handshakes_evicted"] += 1
            log.warning(
                "dropping unauthenticated connection from %s: %d handshakes pending",
                old.peer,
                self.max_handshakes,
            )
            old.closing = True
            if old.transport is not None:
                old.transport.abort()
        self.pending[conn] = None

    def _sweep(self) -> None:
        """Close authenticated connections idle longer than idle_timeout (when set)."""
        assert self.idle_timeout is not None
        cutoff = time.monotonic() - self.idle_timeout
        for c in list(self.conns):
            if c.authed and c.last_active < cutoff and c.transport is not None:
                log.info("closing idle connection from %s", c.peer)
                self.counters["idle_closed"] += 1
                c.transport.close()
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

    def start_rdma(self, host: str, port: int, *, required: bool) -> bool:
        """Listen with rdma-cm on `host`:`port` beside TCP. True when listening; otherwise
        `rdma_error` says why, and OSError is raised when `required`."""
        v = verbs.load()
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
        self.rdma = service
        return True

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for conn in list(self.conns):
                if conn.transport is not None:
                    conn.transport.abort()
            await self._server.wait_closed()
            self._server = None
        await asyncio.sleep(0)  # let connection_lost callbacks run before the arena goes
        if self.rdma is not None:
            self.rdma.close()  # every region before the arena it covers
            self.rdma = None
        self.store.close()
