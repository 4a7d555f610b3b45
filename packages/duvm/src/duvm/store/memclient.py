"""Client of one memserver: one persistent TCP connection, many requests in flight.

Theory of operation:

- `MemClient` owns one connection: its receive side (`memclient_replies.ReplyProtocol`, an
  asyncio BufferedProtocol around `pagedecode.Decoder`) and its send side
  (`memclient_send.SendQueue`: the queue and the table of pending requests keyed by request
  id). Callers `await` a method; every request queued in one event-loop iteration leaves in a
  single `writelines`, so a burst of NBD requests costs one syscall, and consecutive STOREs (or
  LOADs) merge into one frame. The NBD server brackets the requests of one read with its
  store's `batching.cork()`/`uncork()` (`storage.Batching`, shared by one store's
  connections): they leave at `uncork()`, in the same iteration, which spares each request an
  extra loop iteration of latency. Replies may arrive in any order; each completes its own
  future. LOAD replies are copied straight from the receive buffer into the caller's buffer
  (`load(keys, out)`): one copy from socket to destination. If a merged request is refused,
  its parts are sent again one by one, so only the parts that are really refused fail.
- Batches larger than the server's `max_batch` are split and sent concurrently.
- Every request is idempotent (STORE of the same bytes, LOAD, FREE, absolute RESERVE, RELEASE),
  so when the connection drops the client reconnects with the same client id and retries once.
  The memserver keeps the namespace for its lease, so the retry finds the pages. When a
  reconnect finds the namespace gone (lease expired, server restarted) the client restores the
  reservation and counts the loss in `namespace_losses`; the pages themselves are gone, and a
  LOAD of them is refused (NOT_FOUND), never answered with other bytes.
- Dead peers are detected by TCP keepalive and TCP_USER_TIMEOUT, not by per-request timers;
  a caller that wants a tighter bound (RemoteStore's watchdog) reads `stalled_for()` and calls
  `abort()`, which fails the pending requests like a lost connection.
- Circuit breaker: a failed connect (or an abort) opens the breaker for a backoff that doubles
  with each consecutive failure (`BACKOFF_MIN`..`BACKOFF_MAX`, with jitter). While it is open,
  requests fail at once with MemserverUnreachable instead of each waiting for a connect timeout,
  so replicated callers fail over without stalling the kernel. The first request (or `probe()`)
  after the backoff is the half-open trial; a successful HELLO closes the breaker.
- `on_namespace_lost(client)` (optional) is called when a reconnect finds the namespace gone
  (also one resumed, not reserved, here), before the reservation is restored: see `connect`.
- Transport (`transport`): "tcp" moves pages in STORE/LOAD frames; "rdma" and "auto" open an
  RDMA connection after each handshake (`memclient_rdma`, over `rdma_link`): STOREs and LOADs
  then move by one-sided RDMA, the rest by TCP. "rdma" fails the connection when RDMA cannot
  be had; "auto" then uses TCP and says why (`rdma_error`). A broken RDMA connection drops
  the TCP one too, so the store fails over exactly as for a lost TCP connection.
- Fencing (`epoch`, docs/protocol.md): a client given an epoch (at construction, or at run
  time with `set_epoch`, which also fences the live connection) sends FENCE(epoch) on every
  connection right after the handshake, before any other request (RDMA_OPEN, the RESERVE that
  restores a lost namespace, and every caller's request, which wait for the reconnect), so
  the memserver refuses, from then on, every change of the namespace from connections of an
  older generation. A FENCE refused (FENCED) means a newer generation holds the namespace:
  this client is stale, for good (`fenced_out`): its connection is dropped and every later
  request raises PageServerError(FENCED) at once, without connecting again.
  `memclient_group.fence_all` fences a list of clients concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from duvm.store.memclient_rdma import open_rdma
from duvm.store.memclient_replies import Batch, ReplyProtocol
from duvm.store.memclient_send import LOAD as _LOAD
from duvm.store.memclient_send import STORE as _STORE
from duvm.store.memclient_send import send_queue_type
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.rdma_link import RdmaLink
from duvm.store.storage import Batching
from duvm.wire import pageproto as pp
from duvm.wire.auth import AuthError, PeerSecurity, answer_challenge, default_token, start_handshake
from duvm.wire.pageproto import PAGE_SIZE

log = logging.getLogger(__name__)

BACKOFF_MIN = 0.1  # seconds the breaker stays open after the first failure
BACKOFF_MAX = 5.0  # ... and at most, however many failures follow

_FREE = int(pp.MsgType.FREE)
TRANSPORTS = ("tcp", "rdma", "auto")


class MemClient:
    """Connection to one memserver for one namespace (`client_id`).

    `await connect()` (HELLO) first; then `reserve`, `store`, `load`, `free`, `release`,
    `status`; `close()` at the end. Refusals raise `PageServerError` (with `.errno`), a lost
    connection that cannot be restored raises `MemserverUnreachable`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        client_id: str,
        *,
        connect_timeout: float = 5.0,
        retries: int = 1,
        security: PeerSecurity | None = None,
        token: bytes | None = None,
        batching: Batching | None = None,
        transport: str = "tcp",
        chunk_pages: int = 256,
        epoch: int | None = None,
    ) -> None:
        pp.Hello(0, client_id)  # validates the id early
        if epoch is not None:
            pp.Fence(0, epoch)  # validates the epoch early
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        pp.RdmaOpen(0, chunk_pages)  # validates the chunk size early
        self.transport = transport
        self.chunk_pages = chunk_pages  # keys per RDMA chunk: the store's slab
        self.rdma: RdmaLink | None = None  # while pages move by RDMA; else they go by `queue`
        self._staging: Any = None  # the RDMA staging buffer, kept across reconnects
        # where it lives (None: anonymous memory of this process): the daemon's file, which
        # its standby maps too (`duvm.store.daemon_state`)
        self.staging_file: str | None = None
        self.rdma_error: str | None = None  # why the last connect did not get RDMA
        self.host, self.port, self.client_id = host, port, client_id
        # shared with the other connections of one store and the NBD server in front of it
        self.batching = batching if batching is not None else Batching()
        # Authentication (duvm.wire.auth): secret and/or TLS, and the token that owns our namespace
        # on the memserver; kept for every reconnect, so a reconnect finds the namespace again.
        self.security = security
        self.token = token if token is not None else default_token(client_id)
        self.peer = f"{host}:{port}"
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.hello: pp.HelloReply | None = None
        self.namespace_losses = 0  # reconnects that found the namespace gone
        self._proto: ReplyProtocol | None = None
        self.queue = send_queue_type()(self.peer, self.batching)  # the send side
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment] - set by connect
        self._reserved: int | None = None  # last reservation we asked for
        self._reconnecting: asyncio.Task | None = None
        self._closed = False
        self.on_namespace_lost: Callable[[MemClient], None] | None = None
        # the generation this client writes as: FENCE(epoch) on every connection (None: never)
        self.epoch = epoch
        # set when a FENCE was refused: a newer generation holds the namespace; every request
        # fails with it from then on, and no connect is tried again
        self.fenced_out: PageServerError | None = None
        # circuit breaker and stall detection
        self.failures = 0  # consecutive failed connects/aborts; 0 once a HELLO succeeds
        self._retry_logged = False  # "retrying" said since the last successful HELLO
        self.down_since: float | None = None  # monotonic time of the first of those failures
        self.lease_s: float | None = None  # the memserver's namespace lease (from HELLO)
        self.breaker_trips = 0  # times the breaker opened (status)
        self._breaker_until = 0.0  # monotonic time before which no connect is tried
        self.last_rx = 0.0  # when bytes last arrived

    # --- connection ---

    @property
    def pending(self) -> dict[int, Any]:
        """Request id -> its Future, `Callback` or merged `Batch` (ReplyOwner: replies pop
        from it); the send side's table."""
        return self.queue.pending

    @property
    def connected(self) -> bool:
        return self._proto is not None and self.hello is not None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop of its connection (set by `connect`); cached because
        `asyncio.get_running_loop()` costs a getpid() system call on Python 3.11."""
        return self._loop

    @property
    def circuit_open(self) -> bool:
        """True while the breaker refuses to try connecting (backoff after failures)."""
        return not self.connected and time.monotonic() < self._breaker_until

    def _trip(self) -> None:
        """Count a failure and open the breaker for an exponential, jittered backoff."""
        self.failures += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
        self.breaker_trips += 1
        delay = min(BACKOFF_MAX, BACKOFF_MIN * 2 ** min(self.failures - 1, 16))
        self._breaker_until = time.monotonic() + delay * random.uniform(0.75, 1.25)

    def stalled_for(self, now: float) -> float:
        """Seconds requests have been outstanding with no byte (or RDMA completion) received
        (0 when idle)."""
        link = self.rdma
        rdma = now - max(link.busy_since, link.last_completion) if link and link.in_flight else 0.0
        if not self.queue.pending or self._proto is None:
            return rdma
        return max(rdma, now - max(self.queue.busy_since, self.last_rx))

    def abort(self, reason: str) -> None:
        """Drop the connection now (a stalled peer): pending requests fail as on a lost
        connection, and the breaker opens so retries fail fast instead of waiting."""
        proto = self._proto
        if proto is None or proto.transport is None:
            return
        log.warning("memserver %s: %s; dropping the connection", self.peer, reason)
        self._trip()
        proto.transport.abort()

    async def probe(self) -> bool:
        """Try to (re)connect if the breaker allows; True when connected afterwards."""
        if self.connected:
            return True
        if self._closed or self.circuit_open:
            return False
        try:
            await self._ensure_connected()
        except (MemserverUnreachable, PageServerError):
            return False
        return self.connected

    @property
    def max_batch(self) -> int:
        """Pages per request the memserver accepts (protocol maximum before HELLO); at least 1."""
        return self.queue.max_batch

    async def connect(self) -> pp.HelloReply:
        """Connect and say HELLO. Raises MemserverUnreachable or PageServerError (VERSION)."""
        self._closed = False
        loop = self._loop = asyncio.get_running_loop()
        try:
            tls = self.security.tls if self.security is not None else None
            _, proto = await asyncio.wait_for(
                loop.create_connection(
                    lambda: ReplyProtocol(self),
                    self.host,
                    self.port,
                    ssl=tls,
                    server_hostname=self.host if tls else None,
                ),
                self.connect_timeout,
            )
        except (TimeoutError, OSError) as e:  # ssl.SSLError is an OSError
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else e.strerror or e
            raise MemserverUnreachable(f"cannot reach memserver {self.peer}: {reason}") from None
        if proto.lost.done():
            # Lost before create_connection even returned it (reset right after the TCP
            # handshake: a memserver dying as it accepted us). Its connection_lost has run,
            # so nothing would ever fail a request sent on it: the HELLO would wait forever,
            # and every caller waiting for this reconnect with it.
            raise MemserverUnreachable(
                f"cannot reach memserver {self.peer}: the connection was closed as it opened"
            )
        self._proto = proto
        self.queue.connected(loop, proto.transport)  # type: ignore[arg-type]
        try:
            hello, state = start_handshake(self.client_id, self.security, self.token)
            challenge = await self._request(hello)
            reply = await self._request(
                answer_challenge(challenge, state, self.security, self.peer)
            )
            sent = None  # fence before anything else goes out (set_epoch may change it)
            while self.epoch is not None and self.epoch != sent:
                sent = self.epoch
                await self._request(pp.Fence(0, sent))
        except AuthError as e:
            proto.transport.abort()
            self._proto = None
            self.queue.disconnected()
            raise PageServerError(pp.ErrorCode.AUTH, str(e)) from None
        except BaseException as e:
            if isinstance(e, PageServerError) and e.code == pp.ErrorCode.FENCED:
                self._stale(e)
            proto.transport.abort()
            self._proto = None
            self.queue.disconnected()
            raise
        self.hello = reply
        # pages per request: what the server accepts, and what fits its largest frame
        fit = (reply.max_frame - pp.HEADER_SIZE - 8) // (8 + PAGE_SIZE)
        self.queue.max_batch = max(1, min(reply.max_batch, pp.MAX_BATCH, fit))
        if self.transport != "tcp":
            await open_rdma(self, proto)
        if reply.resumed and self._reserved is None:  # a namespace we did not reserve here
            self._reserved = reply.reserved_pages  # (a resume): its loss is noticed as ours
        if not reply.resumed and self._reserved:
            self.namespace_losses += 1
            log.error(
                "memserver %s lost namespace %r (lease expired or restart): its pages are "
                "gone; restoring the reservation",
                self.peer,
                self.client_id,
            )
            if self.on_namespace_lost is not None:
                self.on_namespace_lost(self)
            await self._request(pp.Reserve(0, self._reserved))
        self.failures = 0
        self._retry_logged = False
        self._breaker_until = 0.0
        self.down_since = None
        self.lease_s = reply.lease_ms / 1000
        return reply

    @property
    def rdma_device(self) -> str | None:
        """The verbs device of the RDMA connection (None without one)."""
        return self.rdma.device if self.rdma is not None else None

    @property
    def transport_in_use(self) -> str | None:
        """ "rdma" or "tcp" while connected, else None."""
        if not self.connected:
            return None
        return "rdma" if self.rdma is not None else "tcp"

    def _close_rdma(self) -> None:
        link, self.rdma = self.rdma, None
        if link is not None:
            link.close()  # its requests in flight fail as on a lost connection

    async def close(self) -> None:
        """Close the connection (the namespace stays on the server for its lease)."""
        self._closed = True
        self._close_rdma()
        proto, self._proto = self._proto, None
        self.hello = None
        self.queue.disconnected()
        self.queue.flush()  # what is queued fails now: no connection is left to send it
        if proto is not None and proto.transport is not None:
            proto.transport.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proto.lost), 2.0)

    def reply_connection_lost(self, proto: ReplyProtocol, exc: Exception | None) -> None:
        if self._proto is not None and self._proto is not proto:
            return  # an old connection, already failed when it was replaced: not ours to fail
        self._proto = None
        self.hello = None
        self._close_rdma()
        self.queue.fail_all(
            MemserverUnreachable(
                f"connection to memserver {self.peer} lost" + (f": {exc}" if exc else "")
            )
        )

    async def _ensure_connected(self) -> None:
        if self._closed:
            raise MemserverUnreachable(f"client of memserver {self.peer} is closed")
        if self.fenced_out is not None:
            raise PageServerError(pp.ErrorCode.FENCED, self.fenced_out.message, self.peer)
        if self.connected:
            return
        if self._reconnecting is None or self._reconnecting.done():
            if time.monotonic() < self._breaker_until:
                raise MemserverUnreachable(
                    f"memserver {self.peer} is failing ({self.failures} consecutive failures); "
                    f"next try in {self._breaker_until - time.monotonic():.1f} s"
                )
            self._reconnecting = asyncio.ensure_future(self._reconnect())
        await asyncio.shield(self._reconnecting)

    async def _reconnect(self) -> None:
        try:
            await self.connect()
        except MemserverUnreachable:
            self._trip()
            raise

    # --- requests ---

    def resend_each(self, batch: Batch) -> None:
        """ReplyOwner: queue every still-waiting request of a refused merged batch on its own."""
        self.queue.resend_each(batch)

    async def _request(self, msg: pp.Request) -> Any:
        """One request on the current connection, no retry (HELLO and setup)."""
        if self._proto is None:
            raise MemserverUnreachable(f"not connected to memserver {self.peer}")
        return await self.queue.queue(0, None, None, None, msg)

    def _send(
        self,
        mtype: int,
        keys: tuple[int, ...] | None,
        data: memoryview | None,
        out: memoryview | None,
        msg: pp.Request | None,
    ) -> Awaitable[Any]:
        """One request on the current connection: a STORE or LOAD by RDMA when there is an
        RDMA connection, anything else by TCP."""
        if self.rdma is not None and msg is None and mtype != _FREE:
            return self.rdma.call(mtype == _STORE, keys, data if mtype == _STORE else out)  # type: ignore[arg-type]
        return self.queue.queue(mtype, keys, data, out, msg)

    async def _call(
        self,
        mtype: int,
        keys: tuple[int, ...] | None = None,
        data: memoryview | None = None,
        out: memoryview | None = None,
        msg: pp.Request | None = None,
    ) -> Any:
        """Send a request; on a lost connection reconnect and retry (requests are idempotent)."""
        if self.hello is not None:  # connected: the fast path
            try:
                return await self._send(mtype, keys, data, out, msg)
            except MemserverUnreachable:
                if not self.retries:
                    raise
                if not self._retry_logged:  # once per lost connection, not per request
                    self._retry_logged = True
                    log.warning(
                        "memserver %s: connection lost; reconnecting and retrying its requests",
                        self.peer,
                    )
        for attempt in range(self.retries + 1):
            await self._ensure_connected()
            try:
                return await self._send(mtype, keys, data, out, msg)
            except MemserverUnreachable:
                if attempt == self.retries:
                    raise
        raise AssertionError("unreachable")

    async def reserve(self, pages: int) -> pp.ReserveReply:
        """Set this namespace's reservation to `pages` (absolute)."""
        reply = await self._call(0, msg=pp.Reserve(0, pages))
        self._reserved = pages
        return reply

    async def release(self) -> int:
        """Free every page and the reservation; returns the number of pages freed."""
        reply = await self._call(0, msg=pp.Release(0))
        self._reserved = 0
        return reply.freed_pages

    # The trusted fast path for RemoteStore: `keys` a tuple of valid keys, 1..max_batch of
    # them; `data`/`out` byte memoryviews of exactly len(keys) pages. Nothing is checked, and
    # a lost connection is not retried here: callers fall back to store()/load() for that.

    def store_batch(self, keys: tuple[int, ...], data: memoryview) -> Awaitable[Any]:
        if self.hello is None:
            return self._call(_STORE, keys, data)
        if self.rdma is not None:
            return self.rdma.call(True, keys, data)
        return self.queue.queue(_STORE, keys, data, None)

    def load_batch(self, keys: tuple[int, ...], out: memoryview) -> Awaitable[Any]:
        if self.hello is None:
            return self._call(_LOAD, keys, None, out)
        if self.rdma is not None:
            return self.rdma.call(False, keys, out)
        return self.queue.queue(_LOAD, keys, None, out)

    # The callback fast path (the NBD daemon's hot path): as store_batch/load_batch, but the
    # completion calls `cb(None)` on success or `cb(exc)` on failure (PageServerError,
    # MemserverUnreachable) straight from the receive path. Returns False, queuing nothing,
    # when not connected: the caller then takes its awaitable path, which reconnects.

    def store_cb(
        self, keys: tuple[int, ...], data: memoryview, cb: Callable[[BaseException | None], None]
    ) -> bool:
        if self.hello is None:
            return False
        link = self.rdma
        if link is None or not link.send(True, keys, data, cb):
            self.queue.store_cb(keys, data, cb)
        return True

    def load_cb(
        self, keys: tuple[int, ...], out: memoryview, cb: Callable[[BaseException | None], None]
    ) -> bool:
        if self.hello is None:
            return False
        link = self.rdma
        if link is None or not link.send(False, keys, out, cb):
            self.queue.load_cb(keys, out, cb)
        return True

    async def store(self, keys: Iterable[int], data: bytes | bytearray | memoryview) -> None:
        """Store pages `keys` from `data` (len(keys) * PAGE_SIZE bytes), all or nothing per
        batch of max_batch pages. Refused with PageServerError(NO_SPACE) beyond the
        reservation. `data` must stay unchanged until this returns."""
        keys = pp.keys_tuple(keys)
        mv = _bytes_view(data)
        n = len(keys)
        if mv.nbytes != n * PAGE_SIZE:
            raise ValueError(f"{n} pages need {n * PAGE_SIZE} bytes, got {mv.nbytes}")
        mb = self.max_batch
        if 0 < n <= mb:
            await self._call(_STORE, keys, mv)
        elif n:
            await self._each(
                [
                    self._call(_STORE, keys[i : i + mb], mv[i * PAGE_SIZE : (i + mb) * PAGE_SIZE])
                    for i in range(0, n, mb)
                ]
            )

    async def load(
        self, keys: Iterable[int], out: bytearray | memoryview | None = None
    ) -> bytearray | None:
        """Load pages `keys` into `out` (writable, len(keys) * PAGE_SIZE bytes), or into a new
        bytearray that is returned when `out` is None. A page not stored raises
        PageServerError(NOT_FOUND)."""
        keys = pp.keys_tuple(keys)
        n = len(keys)
        ret = None
        if out is None:
            ret = out = bytearray(n * PAGE_SIZE)
        mv = _bytes_view(out)
        if mv.readonly or mv.nbytes != n * PAGE_SIZE:
            raise ValueError(f"out must be writable and {n * PAGE_SIZE} bytes")
        mb = self.max_batch
        if 0 < n <= mb:
            await self._call(_LOAD, keys, None, mv)
        elif n:
            await self._each(
                [
                    self._call(
                        _LOAD, keys[i : i + mb], None, mv[i * PAGE_SIZE : (i + mb) * PAGE_SIZE]
                    )
                    for i in range(0, n, mb)
                ]
            )
        return ret

    async def free(self, keys: Iterable[int]) -> int:
        """Free pages `keys`; returns how many were stored. Absent keys are not an error."""
        keys = pp.keys_tuple(keys)
        mb = self.max_batch
        replies = await self._each(
            [self._call(_FREE, keys[i : i + mb]) for i in range(0, len(keys), mb)]
        )
        return sum(r.freed for r in replies)

    async def fence(self, epoch: int) -> int:
        """FENCE(epoch) on the current connection (connecting first if need be): the
        memserver refuses, from now on, every change of this namespace from connections of a
        lower epoch. Returns the namespace's epoch. Raises PageServerError(FENCED) when the
        namespace is at a higher epoch (this client is then stale for good: `fenced_out`).
        A reconnect does not repeat this one; `set_epoch` (or `epoch`) makes every one do it."""
        msg = pp.Fence(0, epoch)  # validates: LocalProtocolError for 0 or beyond 64 bits
        try:
            reply = await self._call(0, msg=msg)
        except PageServerError as e:
            if e.code == pp.ErrorCode.FENCED:
                self._stale(e)
            raise
        return reply.epoch

    async def set_epoch(self, epoch: int) -> int | None:
        """Write as generation `epoch` from now on (a standby taking over): every connection
        is fenced with it, the live one now. Returns the namespace's epoch, or None when not
        connected (the next connect fences). Raises as `fence`."""
        pp.Fence(0, epoch)
        self.epoch = epoch
        if not self.connected:
            return None
        return await self.fence(epoch)

    def _stale(self, e: PageServerError) -> None:
        """A FENCE was refused: a newer generation holds the namespace. For good: drop the
        connection, and fail every request from now on (no reconnect)."""
        if self.fenced_out is None:
            log.error(
                "memserver %s: namespace %r is held by a newer generation (%s); this client stops",
                self.peer,
                self.client_id,
                e.message,
            )
        self.fenced_out = e
        proto = self._proto
        if proto is not None and proto.transport is not None:
            proto.transport.abort()

    async def status(self) -> dict:
        """The memserver's STATUS (see docs/protocol.md for the fields)."""
        reply = await self._call(0, msg=pp.Status(0))
        return json.loads(reply.json)

    @staticmethod
    async def _each(coros: list) -> list:
        """Await all parts, then raise the first failure: no part may still be using the
        caller's buffer after we return."""
        res = await asyncio.gather(*coros, return_exceptions=True)
        for r in res:
            if isinstance(r, BaseException):
                raise r
        return res


def _bytes_view(buf: bytes | bytearray | memoryview) -> memoryview:
    """`buf` as a flat memoryview of bytes (itself when it already is one)."""
    if isinstance(buf, memoryview) and buf.format == "B":
        return buf
    return memoryview(buf).cast("B")
