"""One NBD client connection of `duvm.node.nbdserver`: the handshake, then many requests in
flight, each handed to the store and answered; the hot path of every swap request.

Theory of operation
-------------------
Each connection is an `asyncio.BufferedProtocol`. During the handshake it feeds bytes to a
`nbdproto.Handshake`; once transmission starts the socket is read with recv_into straight into
the `TransmissionDecoder`'s buffer (large write payloads straight into the pooled buffer that
the store then receives). Requests arrive validated; invalid ones are answered at once with
their error and never reach the store.

Many requests are in flight per connection and replies go out in completion order. A store
that declares the callback fast path (`BlockStore.fast_path`) is handed READs and flagless
WRITEs by `start_read`/`start_write`: its callback answers the request, or hands back a
coroutine that finishes it. Every other request, and every coroutine handed back, runs as an
asyncio Task; its done-callback answers the request.

Replies are batched: completions append their header and (for reads) the pooled buffer the
store filled to a list, written with one `writelines` (one writev) at the end of the loop
iteration that produced it; the buffers go back to the pool once the transport has sent them.
Flow control keeps memory bounded: reading pauses while too many requests or bytes are in
flight or while the transport's write buffer is above its high-water mark.

NBD_CMD_DISC and server shutdown both let in-flight requests finish and their replies go out
before the socket closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections.abc import Coroutine
from functools import partial
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from duvm.base.sockets import set_buffers
from duvm.store.storage import StorageError
from duvm.wire import nbdconst as C
from duvm.wire.nbdproto import (
    Handshake,
    HandshakeState,
    NbdProtocolError,
    Request,
    TransmissionDecoder,
    transmission_decoder,
    wire_error,
)

if TYPE_CHECKING:
    from duvm.node.nbdserver import NBDServer

log = logging.getLogger("duvm.nbd")

DEFAULT_HANDSHAKE_TIMEOUT = 30.0  # seconds a client may take to negotiate
_SOCK_BUF = 4 << 20  # whole large replies fit, so one send per batch
_PACK_REPLY = C.SIMPLE_REPLY.pack
_REPLY_MAGIC = C.SIMPLE_REPLY_MAGIC
_FUA_CMDS = frozenset((C.CMD_WRITE, C.CMD_TRIM, C.CMD_WRITE_ZEROES))
_CMD_READ = C.CMD_READ
_CMD_WRITE = C.CMD_WRITE


class NBDConnection(asyncio.BufferedProtocol):
    """One client connection: handshake, then many concurrent requests."""

    def __init__(self, server: NBDServer) -> None:
        self.server = server
        self.store = server.store
        self.stats = server.stats
        self.pool = server.pool
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self._hs: Handshake | None = Handshake([server.export])
        self._hs_buf = bytearray(4096)
        self._dec: TransmissionDecoder | None = None
        self._loop = asyncio.get_running_loop()
        self._hs_timer: asyncio.TimerHandle | None = None
        # reply batching
        self._segments: list[bytes | memoryview] = []
        self._held: list[memoryview] = []  # buffers the transport may still be sending from
        self._sent_held: list[memoryview] = []
        self._flush_scheduled = False
        # flow control
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._read_paused = False
        self._write_paused = False
        self._disconnecting = False  # DISC received or server shutting down
        self._closed = False
        # the Tasks running store coroutines, by request
        self._waiting: dict[Request, asyncio.Task] = {}
        self._aborted = False
        # the store's request batching (storage.Batching), looked up once per connection
        self._batching = self.store.batching
        # the store's callback fast path, when it declares one (BlockStore.fast_path)
        entries = self.store.fast_entries() if self.store.fast_path else (None, None)
        self._start_read, self._start_write = entries
        self._lat = server.latency  # request start times only when metrics are on
        self._trace = server.trace  # or a trace is written
        self._timed = self._lat is not None or self._trace is not None
        self._t0: dict[Request, int] = {}

    # ---------------------------------------------------------------- connection events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = transport  # type: ignore[assignment]
        self.server._connections.add(self)
        self.stats.connections += 1
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self.peer = str(sock.getpeername() or "unix")
            _tune_socket(sock)
        self.transport.set_write_buffer_limits(high=8 << 20, low=1 << 20)
        if self.server._closing:
            self.transport.abort()
            return
        if len(self.server._connections) > self.server.max_connections:
            log.warning("refusing connection: already %d connections", self.server.max_connections)
            self.transport.abort()
            return
        assert self._hs is not None
        self.transport.write(self._hs.data_to_send())
        # A client that never finishes negotiating must not hold a connection slot forever.
        self._hs_timer = self._loop.call_later(
            self.server.handshake_timeout, self._handshake_timeout
        )

    def _handshake_timeout(self) -> None:
        if self._dec is None and self.transport is not None:
            self.stats.protocol_errors += 1
            self.abort(f"no NBD handshake within {self.server.handshake_timeout:g} s")

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        if self._hs_timer is not None:
            self._hs_timer.cancel()
        self.server._connections.discard(self)
        self.transport = None
        self._segments.clear()
        self._held.clear()
        self._sent_held.clear()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dec is not None:
            return self._dec.get_buffer()
        return memoryview(self._hs_buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self._dec is not None:
            self._dec.buffer_updated(nbytes)
            self._process()
        else:
            self._handshake(bytes(self._hs_buf[:nbytes]))

    def eof_received(self) -> bool:
        # The client half-closed: finish what is in flight, then close.
        self._disconnecting = True
        self._maybe_close()
        return True

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    # ---------------------------------------------------------------- handshake

    def _handshake(self, data: bytes) -> None:
        hs = self._hs
        assert hs is not None and self.transport is not None
        try:
            hs.receive_data(data)
        except NbdProtocolError as e:
            self.stats.protocol_errors += 1
            self.transport.write(hs.data_to_send())
            self.abort(f"handshake: {e}")
            return
        out = hs.data_to_send()
        if out:
            self.transport.write(out)
        if hs.state is HandshakeState.CLOSED:
            log.debug("%s: %s", self.peer, hs.close_reason)
            self.transport.close()
        elif hs.state is HandshakeState.TRANSMISSION:
            assert hs.export is not None
            self._dec = transmission_decoder(hs.export, self.pool)
            self._hs = None
            if self._hs_timer is not None:
                self._hs_timer.cancel()
            if hs.trailing:
                self._dec.receive_data(hs.trailing)
                self._process()

    # ---------------------------------------------------------------- transmission

    def _process(self) -> None:
        dec = self._dec
        assert dec is not None
        next_request = dec.next_request
        dispatch = self._dispatch
        max_reqs = self.server.max_in_flight
        max_bytes = self.server.max_in_flight_bytes
        # Requests the store sends to memservers while dispatching this read merge and leave
        # together when uncorked, in this loop iteration (see storage.Batching).
        batching = self._batching
        corked = batching.cork()
        try:
            while not self._disconnecting:
                if self._in_flight >= max_reqs or self._in_flight_bytes >= max_bytes:
                    break  # resumed from _done once replies drain the backlog
                req = next_request()
                if req is None:
                    break
                dispatch(req)
        except NbdProtocolError as e:
            self.stats.protocol_errors += 1
            self.abort(str(e))
            return
        finally:
            if corked:
                batching.uncork()
        self._update_reading()
        self._flush()

    def _dispatch(self, req: Request) -> None:
        self.stats.requests += 1
        if req.error:
            self._reply_error(req, req.error)
            return
        cmd = req.cmd
        store = self.store
        if cmd == _CMD_READ:
            n = req.length
            if not n:
                self._segments.append(_PACK_REPLY(_REPLY_MAGIC, 0, req.cookie))
                return
            buf = req.buffer = self.pool.acquire(n)
            view = req.payload = buf if len(buf) == n else buf[:n]
            self._in_flight_bytes += n
            if self._start_read is not None and self._started(self._start_read, req, view):
                return
            coro = store.read(req.offset, view)
        elif cmd == _CMD_WRITE:
            if not req.length:
                self._segments.append(_PACK_REPLY(_REPLY_MAGIC, 0, req.cookie))
                return
            self._in_flight_bytes += req.length
            if (
                self._start_write is not None
                and not req.flags
                and self._started(self._start_write, req, req.payload)
            ):
                return
            coro = store.write(req.offset, req.payload)  # type: ignore[arg-type]
        elif cmd == C.CMD_TRIM:
            coro = store.trim(req.offset, req.length)
        elif cmd == C.CMD_WRITE_ZEROES:
            coro = store.write_zeroes(req.offset, req.length)
        elif cmd == C.CMD_FLUSH:
            coro = store.flush()
        else:  # DISC (the decoder lets through only commands the export offers)
            self._disconnecting = True
            self._maybe_close()
            return
        if req.flags & C.CMD_FLAG_FUA and cmd in _FUA_CMDS:
            coro = self._then_flush(coro)
        if self._timed:
            self._t0[req] = perf_counter_ns()
        self._in_flight += 1
        self._run(req, coro)

    def _started(self, start: Any, req: Request, view: memoryview | None) -> bool:
        """Hand a READ or WRITE to the store's callback fast path; False if it declined."""
        if self._timed:
            self._t0[req] = perf_counter_ns()
        self._in_flight += 1
        try:
            taken = start(req.offset, view, self._fast_done, req)
        except Exception:  # a store bug: answer EIO rather than leave the request hanging
            log.exception("%s: store failed on %r", self.peer, req)
            self._done(req, errno.EIO)
            return True
        if taken:
            if self._in_flight > self.stats.peak_in_flight:
                self.stats.peak_in_flight = self._in_flight
            return True
        self._in_flight -= 1
        self._t0.pop(req, None)
        return False

    def _fast_done(self, req: Any, cont: Any) -> None:
        """Completion of a fast-path request (see BlockStore.start_read): None finished,
        a coroutine continues the request, an exception failed it."""
        if self._aborted:
            if cont is not None and not isinstance(cont, BaseException):
                cont.close()
            return
        if cont is None:
            self._done(req, 0)
        elif isinstance(cont, memoryview):  # answered from the store's own buffer: no copy
            if req.buffer is not None:
                self.pool.release(req.buffer)
                req.buffer = None
            req.payload = cont
            self._done(req, 0)
        elif isinstance(cont, BaseException):
            if isinstance(cont, StorageError):
                self._done(req, cont.errno)
            else:
                log.error("%s: store failed on %r: %r", self.peer, req, cont)
                self._done(req, errno.EIO)
        else:
            self._run(req, cont)  # the general path takes over (a failover, a retry)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # Many replies arrive in one read from a memserver: answer them in one write.
            if not self._batching.after_replies(self._flush):
                self._loop.call_soon(self._flush)

    def _run(self, req: Request, coro: Coroutine[Any, Any, None]) -> None:
        """Run a store coroutine as a Task; `_finished` answers the request."""
        task = self._loop.create_task(coro)
        self._waiting[req] = task
        task.add_done_callback(partial(self._finished, req))
        if self._in_flight > self.stats.peak_in_flight:
            self.stats.peak_in_flight = self._in_flight

    async def _then_flush(self, coro: Coroutine[Any, Any, None]) -> None:
        await coro
        await self.store.flush()

    def _finished(self, req: Request, task: asyncio.Task) -> None:
        if self._waiting.pop(req, None) is None:
            return  # the connection was aborted and the task cancelled
        if task.cancelled():
            err = errno.EIO
        elif (exc := task.exception()) is None:
            err = 0
        elif isinstance(exc, StorageError):
            err = exc.errno
        else:
            log.error("%s: store failed on %r", self.peer, req, exc_info=exc)
            err = errno.EIO
        self._done(req, err)
        if not self._flush_scheduled:  # replies completed in this iteration leave together
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _done(self, req: Request, err: int) -> None:
        """A request finished: queue its reply, give buffers back, update flow control."""
        self._in_flight -= 1
        cmd = req.cmd
        buf = req.buffer
        if self._timed:
            t0, t1 = self._t0.pop(req), perf_counter_ns()
            if self._lat is not None:
                self._lat.observe_ns(cmd, t1 - t0)
            if self._trace is not None:
                self._trace.record(cmd, req.offset, req.length, t0, t1, err)
        if cmd <= _CMD_WRITE:
            self._in_flight_bytes -= req.length
        if err:
            if buf is not None:
                self.pool.release(buf)
            self._reply_error(req, err)
        elif cmd == _CMD_READ:
            # Header and payload go out by reference (writev); the buffer comes back to the
            # pool once the transport has sent it.
            self._segments += (_PACK_REPLY(_REPLY_MAGIC, 0, req.cookie), req.payload)
            if buf is not None:  # None: the payload is the store's (a readahead window)
                self._held.append(buf)
        else:
            if buf is not None:
                self.pool.release(buf)
            self._segments.append(_PACK_REPLY(_REPLY_MAGIC, 0, req.cookie))
        req.buffer = req.payload = None
        if self._read_paused:
            self._update_reading()
        if self._disconnecting:
            self._maybe_close()

    def _reply_error(self, req: Request, err: int) -> None:
        self.stats.errors += 1
        if err not in (errno.EINVAL, errno.ENOSPC, errno.EPERM):
            log.warning("%s: %r failed: %s", self.peer, req, os.strerror(err))
        self._segments.append(_PACK_REPLY(_REPLY_MAGIC, wire_error(err, req.flags), req.cookie))

    def _flush(self) -> None:
        """Write the batch of replies collected since the last flush, in one writelines."""
        self._flush_scheduled = False
        t = self.transport
        if t is None:
            return
        # Buffers handed to the transport at earlier flushes are free once it has nothing
        # left to send (uvloop sends at the end of the loop iteration, so not at once).
        if self._sent_held and not t.get_write_buffer_size():
            release = self.pool.release
            for b in self._sent_held:
                release(b)
            self._sent_held.clear()
        if self._segments:
            t.writelines(self._segments)
            self._segments = []
            if self._held:
                self._sent_held += self._held
                self._held.clear()
        if self._disconnecting:
            self._maybe_close()

    # ---------------------------------------------------------------- flow control, closing

    def _update_reading(self) -> None:
        t = self.transport
        if t is None or self._dec is None:
            return
        busy = (
            self._write_paused
            or self._disconnecting
            or self._in_flight >= self.server.max_in_flight
            or self._in_flight_bytes >= self.server.max_in_flight_bytes
        )
        if busy and not self._read_paused:
            self._read_paused = True
            t.pause_reading()
        elif not busy and self._read_paused:
            self._read_paused = False
            t.resume_reading()
            # Requests may already be complete in the decoder's buffer.
            if self._dec.buffered:
                self._loop.call_soon(self._process_if_open)

    def _process_if_open(self) -> None:
        if self.transport is not None and not self._disconnecting:
            self._process()

    def _maybe_close(self) -> None:
        if self._in_flight or self.transport is None:
            return
        if self._segments:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            return
        self.transport.close()  # sends what is buffered, then closes

    def shutdown(self) -> None:
        """Server is stopping: read nothing more, finish in-flight requests, close."""
        self._disconnecting = True
        if self.transport is not None and self._dec is None:
            self.transport.close()  # still negotiating: nothing in flight
            return
        self._update_reading()
        self._maybe_close()

    def abort(self, reason: str) -> None:
        log.warning("%s: closing connection: %s", self.peer, reason)
        self._disconnecting = True
        self._aborted = True  # fast-path completions still to come are dropped
        if self.transport is not None:
            self.transport.abort()
        waiting, self._waiting = self._waiting, {}
        for task in waiting.values():
            task.cancel()


def _tune_socket(sock: socket.socket) -> None:
    """Big socket buffers (one send per reply batch) and no Nagle delay on TCP."""
    set_buffers(sock, _SOCK_BUF)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
