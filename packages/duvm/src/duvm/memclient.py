"""Client of one memserver: one persistent TCP connection, many requests in flight.

Theory of operation:

- `MemClient` owns one connection (an asyncio BufferedProtocol around `pageproto.Decoder`) and
  a table of pending requests keyed by request id. Callers `await` a method; the request is
  queued, and every request queued in one event-loop iteration leaves in a single `writelines`
  (corking), so a burst of NBD requests costs one syscall. Replies may arrive in any order;
  each completes its own future. LOAD replies are copied straight from the receive buffer into
  the caller's buffer (`load(keys, out)`): one copy from socket to destination.
- Batches larger than the server's `max_batch` are split and sent concurrently.
- Every request is idempotent (STORE of the same bytes, LOAD, FREE, absolute RESERVE, RELEASE),
  so when the connection drops the client reconnects with the same client id and retries once.
  The memserver keeps the namespace for its lease, so the retry finds the pages. When a
  reconnect finds the namespace gone (lease expired, server restarted) the client restores the
  reservation and counts the loss in `namespace_losses`; the pages themselves are gone, and a
  LOAD of them is refused (NOT_FOUND), never answered with other bytes.
- Dead peers are detected by TCP keepalive and TCP_USER_TIMEOUT, not by per-request timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
from array import array
from collections.abc import Iterable
from typing import Any

from duvm import pageproto as pp
from duvm.pageproto import PAGE_SIZE

log = logging.getLogger(__name__)

SOCKET_BUFFER = 4 << 20  # bytes; holds a whole max-size frame in flight
USER_TIMEOUT_MS = 15000  # unacknowledged data this long -> the connection is dead


class PageServerError(Exception):
    """The memserver refused a request (full, absent page, bad version ...)."""

    def __init__(self, code: pp.ErrorCode, message: str, peer: str = "") -> None:
        super().__init__(f"memserver {peer}: {code.name}: {message}" if peer else message)
        self.code = code
        self.errno = code.to_errno()
        self.message = message


class MemserverUnreachable(ConnectionError):
    """The memserver cannot be reached or the connection broke and could not be restored."""


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay on small frames, buffers for whole large frames, dead-peer detection."""
    opts = [
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
        (socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER),
        (socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER),
        (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    ]
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):  # fmt: skip
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        # not TCP (a Unix socket) or not permitted: the defaults still work
        with contextlib.suppress(OSError):
            sock.setsockopt(level, opt, value)


class _ClientProto(asyncio.BufferedProtocol):
    def __init__(self, client: MemClient) -> None:
        self.client = client
        self.decoder = pp.Decoder("client")
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # uvloop: not a subclass
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            tune_socket(sock)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        dec, pending = self.decoder, self.client._pending
        dec.buffer_updated(nbytes)
        try:
            while True:
                msg = dec.next_event()
                if msg is pp.NEED_DATA:
                    return
                entry = pending.pop(msg.req_id, None)
                if entry is None:
                    raise pp.RemoteProtocolError(f"reply to unknown request id {msg.req_id}")
                fut, out = entry
                if fut.done():  # the caller was cancelled; drop the reply
                    continue
                if type(msg) is pp.LoadReply:
                    if out is None or msg.data.nbytes != out.nbytes:
                        raise pp.RemoteProtocolError("LOAD reply does not match its request")
                    out[:] = msg.data
                    fut.set_result(None)
                elif type(msg) is pp.ErrorReply:
                    fut.set_exception(PageServerError(msg.code, msg.message, self.client.peer))
                else:
                    fut.set_result(msg)
        except pp.RemoteProtocolError as e:
            log.warning("memserver %s broke the protocol: %s; closing", self.client.peer, e)
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        self.client._connection_lost(self, exc)


class MemClient:
    """Connection to one memserver for one namespace (`client_id`).

    `await connect()` (HELLO) first; then `reserve`, `store`, `load`, `free`, `release`,
    `status`; `close()` at the end. Refusals raise `PageServerError` (with `.errno`), a lost
    connection that cannot be restored raises `MemserverUnreachable`.
    """

    def __init__(self, host: str, port: int, client_id: str, *, connect_timeout: float = 5.0,
                 retries: int = 1) -> None:  # fmt: skip
        pp.Hello(0, client_id)  # validates the id early
        self.host, self.port, self.client_id = host, port, client_id
        self.peer = f"{host}:{port}"
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.hello: pp.HelloReply | None = None
        self.namespace_losses = 0  # reconnects that found the namespace gone
        self._proto: _ClientProto | None = None
        self._pending: dict[int, tuple[asyncio.Future, memoryview | None]] = {}
        self._ids = itertools.count(1)
        self._outq: list[bytes | memoryview] = []
        self._flush_handle: asyncio.Handle | None = None
        self._reserved: int | None = None  # last reservation we asked for
        self._reconnecting: asyncio.Task | None = None
        self._closed = False

    # --- connection ---

    @property
    def connected(self) -> bool:
        return self._proto is not None and self.hello is not None

    @property
    def max_batch(self) -> int:
        return self.hello.max_batch if self.hello else pp.MAX_BATCH

    async def connect(self) -> pp.HelloReply:
        """Connect and say HELLO. Raises MemserverUnreachable or PageServerError (VERSION)."""
        self._closed = False
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: _ClientProto(self), self.host, self.port),
                self.connect_timeout,
            )
        except (TimeoutError, OSError) as e:
            reason = "timed out" if isinstance(e, asyncio.TimeoutError) else e.strerror or e
            raise MemserverUnreachable(f"cannot reach memserver {self.peer}: {reason}") from None
        self._proto = proto
        try:
            reply = await self._request(pp.Hello(next(self._ids), self.client_id))
        except BaseException:
            proto.transport.abort()
            self._proto = None
            raise
        self.hello = reply
        if not reply.resumed and self._reserved:
            self.namespace_losses += 1
            log.error("memserver %s lost namespace %r (lease expired or restart): its pages are "
                      "gone; restoring the reservation", self.peer, self.client_id)  # fmt: skip
            await self._request(pp.Reserve(next(self._ids), self._reserved))
        return reply

    async def close(self) -> None:
        """Close the connection (the namespace stays on the server for its lease)."""
        self._closed = True
        proto, self._proto = self._proto, None
        self.hello = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush()
        if proto is not None and proto.transport is not None:
            proto.transport.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(proto.lost), 2.0)

    def _connection_lost(self, proto: _ClientProto, exc: Exception | None) -> None:
        if self._proto is proto:
            self._proto = None
            self.hello = None
        self._outq.clear()
        err = MemserverUnreachable(f"connection to memserver {self.peer} lost"
                                   + (f": {exc}" if exc else ""))  # fmt: skip
        pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def _ensure_connected(self) -> None:
        if self._closed:
            raise MemserverUnreachable(f"client of memserver {self.peer} is closed")
        if self.connected:
            return
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self.connect())
        await asyncio.shield(self._reconnecting)

    # --- requests ---

    def _send(self, msg: pp.Request, out: memoryview | None = None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.req_id] = (fut, out)
        self._outq += pp.encode(msg)
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._flush_handle = None
        q, self._outq = self._outq, []
        if q and self._proto is not None and self._proto.transport is not None:
            self._proto.transport.writelines(q)

    async def _request(self, msg: pp.Request, out: memoryview | None = None) -> Any:
        if self._proto is None:
            raise MemserverUnreachable(f"not connected to memserver {self.peer}")
        return await self._send(msg, out)

    async def _call(self, build, out: memoryview | None = None) -> Any:
        """Send build(req_id), reconnecting and retrying (requests are idempotent)."""
        for attempt in range(self.retries + 1):
            await self._ensure_connected()
            try:
                return await self._send(build(next(self._ids)), out)
            except MemserverUnreachable:
                if attempt == self.retries:
                    raise
                log.warning("retrying request to memserver %s after reconnect", self.peer)
        raise AssertionError("unreachable")

    async def reserve(self, pages: int) -> pp.ReserveReply:
        """Set this namespace's reservation to `pages` (absolute)."""
        reply = await self._call(lambda rid: pp.Reserve(rid, pages))
        self._reserved = pages
        return reply

    async def release(self) -> int:
        """Free every page and the reservation; returns the number of pages freed."""
        reply = await self._call(pp.Release)
        self._reserved = 0
        return reply.freed_pages

    async def store(self, keys: Iterable[int], data: bytes | bytearray | memoryview) -> None:
        """Store pages `keys` from `data` (len(keys) * PAGE_SIZE bytes)."""
        keys = pp.keys_array(keys)
        mv = memoryview(data).cast("B")
        if mv.nbytes != len(keys) * PAGE_SIZE:
            raise ValueError(f"{len(keys)} pages need {len(keys) * PAGE_SIZE} bytes, "
                             f"got {mv.nbytes}")  # fmt: skip
        mb = self.max_batch
        if len(keys) <= mb:
            await self._call(lambda rid: pp.Store(rid, keys, mv))
            return
        await asyncio.gather(*(
            self._call(lambda rid, i=i: pp.Store(rid, keys[i : i + mb],
                                                 mv[i * PAGE_SIZE : (i + mb) * PAGE_SIZE]))
            for i in range(0, len(keys), mb)
        ))  # fmt: skip

    async def load(self, keys: Iterable[int], out: bytearray | memoryview | None = None
                   ) -> bytearray | None:  # fmt: skip
        """Load pages `keys` into `out` (writable, len(keys) * PAGE_SIZE bytes), or into a new
        bytearray that is returned when `out` is None. A page not stored raises
        PageServerError(NOT_FOUND)."""
        keys = pp.keys_array(keys)
        ret = None
        if out is None:
            ret = out = bytearray(len(keys) * PAGE_SIZE)
        mv = memoryview(out).cast("B")
        if mv.readonly or mv.nbytes != len(keys) * PAGE_SIZE:
            raise ValueError(f"out must be writable and {len(keys) * PAGE_SIZE} bytes")
        mb = self.max_batch
        if len(keys) <= mb:
            await self._call(lambda rid: pp.Load(rid, keys), mv)
        else:
            await asyncio.gather(*(
                self._call(lambda rid, i=i: pp.Load(rid, keys[i : i + mb]),
                           mv[i * PAGE_SIZE : (i + mb) * PAGE_SIZE])
                for i in range(0, len(keys), mb)
            ))  # fmt: skip
        return ret

    async def free(self, keys: Iterable[int]) -> int:
        """Free pages `keys`; returns how many were stored. Absent keys are not an error."""
        keys = pp.keys_array(keys)
        if not keys:
            return 0
        mb = self.max_batch
        replies = await asyncio.gather(*(
            self._call(lambda rid, i=i: pp.Free(rid, keys[i : i + mb]))
            for i in range(0, len(keys), mb)
        ))  # fmt: skip
        return sum(r.freed for r in replies)

    async def status(self) -> dict:
        """The memserver's STATUS (see docs/protocol.md for the fields)."""
        reply = await self._call(pp.Status)
        return json.loads(reply.json)


async def query_status(host: str, port: int, *, timeout: float = 5.0) -> dict:
    """One memserver's STATUS without joining any namespace (monitoring, `duvm status`).
    Raises MemserverUnreachable when it cannot be reached within `timeout`."""
    peer = f"{host}:{port}"
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(pp.encode_bytes(pp.Status(1)))
                dec = pp.Decoder("client")
                while True:
                    msg = dec.next_event()
                    if msg is not pp.NEED_DATA:
                        break
                    dec.receive_data(await reader.read(1 << 16))  # b"" marks the end
            finally:
                writer.close()
    except (OSError, TimeoutError) as e:
        reason = "timed out" if isinstance(e, TimeoutError) else e.strerror or e
        raise MemserverUnreachable(f"cannot reach memserver {peer}: {reason}") from None
    except pp.RemoteProtocolError as e:
        raise MemserverUnreachable(f"memserver {peer} answered STATUS badly: {e}") from None
    if isinstance(msg, pp.ErrorReply):
        raise PageServerError(msg.code, msg.message, peer)
    if not isinstance(msg, pp.StatusReply):
        raise MemserverUnreachable(f"memserver {peer} answered STATUS with {type(msg).__name__}")
    return json.loads(msg.json)


def keys_range(first: int, count: int) -> array:
    """array('Q') of `count` consecutive page numbers from `first`."""
    return array("Q", range(first, first + count))
