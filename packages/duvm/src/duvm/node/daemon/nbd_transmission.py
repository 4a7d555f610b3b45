"""The transmission phase of one NBD connection (`duvm.node.daemon.nbdconnection`): requests
decoded, handed to the store, answered, their replies batched; the per-request work of every swap
request.

Theory of operation
-------------------
The connection's socket is read with recv_into straight into the `TransmissionDecoder`'s
buffer (large write payloads straight into the pooled buffer that the store then receives).
Requests arrive validated; invalid ones are answered at once with their error and never reach
the store.

Many requests are in flight and replies go out in completion order. A store that declares the
callback fast path (`BlockStore.fast_path`) is handed READs and flagless WRITEs by
`start_read`/`start_write`: its callback answers the request, or hands back a coroutine that
finishes it. Every other request, and every coroutine handed back, runs as an asyncio Task;
its done-callback answers the request.

Replies are batched: completions append their header and (for reads) the pooled buffer the
store filled to a list, written with one `writelines` (one writev) at the end of the loop
iteration that produced it; the buffers go back to the pool once the transport has sent them.
Flow control keeps memory bounded: reading pauses while too many requests or bytes are in
flight or while the transport's write buffer is above its high-water mark.

NBD_CMD_DISC, end of input and server shutdown (`finish`) let in-flight requests finish and
their replies go out before the socket closes; `abort` drops them.

The per-request work runs compiled where the compiled path is built: `Transmission` has a
twin in `duvm.node.daemon._transmission` (`transmission_type` chooses), held to the same behaviour
by tests/test_nbd_transmission.py. This module stays the reference.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import Coroutine
from functools import partial
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from duvm.base import accel
from duvm.store.storage import StorageError
from duvm.wire import nbdconst as C
from duvm.wire.nbdproto import NbdProtocolError, Request, TransmissionDecoder, wire_error

if TYPE_CHECKING:
    from duvm.node.daemon.nbdserver import NBDServer

log = logging.getLogger("duvm.nbd")

_PACK_REPLY = C.SIMPLE_REPLY.pack
_REPLY_MAGIC = C.SIMPLE_REPLY_MAGIC
_FUA_CMDS = frozenset((C.CMD_WRITE, C.CMD_TRIM, C.CMD_WRITE_ZEROES))
_CMD_READ = C.CMD_READ
_CMD_WRITE = C.CMD_WRITE
# Errors a client provokes itself (a bad range, a full pool, a read-only export): not logged.
QUIET_ERRORS = frozenset((errno.EINVAL, errno.ENOSPC, errno.EPERM))


class Transmission:
    """The requests of one NBD connection after its handshake (see the module docstring).

    The connection forwards its transport's events: `get_buffer`/`received` (bytes arrived),
    `write_paused` (the transport's write buffer crossed a limit), `finish` (end of input or
    server shutdown), `abort`, `lost` (the connection is gone)."""

    __slots__ = (
        "_aborted",
        "_batching",
        "_dec",
        "_disconnecting",
        "_flush_scheduled",
        "_held",
        "_in_flight",
        "_in_flight_bytes",
        "_lat",
        "_loop",
        "_max_bytes",
        "_max_reqs",
        "_read_paused",
        "_segments",
        "_sent_held",
        "_start_read",
        "_start_write",
        "_t0",
        "_timed",
        "_trace",
        "_waiting",
        "_write_paused",
        "peer",
        "pool",
        "stats",
        "store",
        "transport",
    )

    def __init__(
        self,
        server: NBDServer,
        transport: asyncio.Transport,
        decoder: TransmissionDecoder,
        peer: str,
    ) -> None:
        self.store = server.store
        self.stats = server.stats  # requests, errors, peak_in_flight are counted here
        self.pool = server.pool
        self.transport: asyncio.Transport | None = transport
        self.peer = peer
        self._dec = decoder
        self._loop = asyncio.get_running_loop()
        self._max_reqs = server.max_in_flight
        self._max_bytes = server.max_in_flight_bytes
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
        self._disconnecting = False  # DISC received, end of input, or server shutting down
        self._aborted = False  # fast-path completions still to come are dropped
        # the Tasks running store coroutines, by request
        self._waiting: dict[Request, asyncio.Task] = {}
        # the store's request batching (storage.Batching), looked up once per connection
        self._batching = self.store.batching
        # the store's callback fast path, when it declares one (BlockStore.fast_path)
        entries = self.store.fast_entries() if self.store.fast_path else (None, None)
        self._start_read, self._start_write = entries
        self._lat = server.latency  # request start times only when metrics are on
        self._trace = server.trace  # or a trace is written
        self._timed = self._lat is not None or self._trace is not None
        self._t0: dict[Request, int] = {}

    # ---------------------------------------------------------------- the transport's events

    def get_buffer(self) -> memoryview:
        return self._dec.get_buffer()

    def received(self, nbytes: int) -> None:
        """`nbytes` arrived in the buffer of the last `get_buffer`."""
        self._dec.buffer_updated(nbytes)
        self._process()

    def receive_data(self, data: bytes) -> None:
        """Bytes that arrived some other way (those right after the handshake)."""
        self._dec.receive_data(data)
        self._process()

    def write_paused(self, paused: bool) -> None:
        self._write_paused = paused
        self._update_reading()

    def finish(self) -> None:
        """Read nothing more; close once in-flight requests are answered."""
        self._disconnecting = True
        self._update_reading()
        self._maybe_close()

    def abort(self, reason: str) -> None:
        """Close at once; requests in flight are dropped unanswered."""
        log.warning("%s: closing connection: %s", self.peer, reason)
        self._disconnecting = True
        self._aborted = True
        if self.transport is not None:
            self.transport.abort()
        waiting, self._waiting = self._waiting, {}
        for task in waiting.values():
            task.cancel()

    def lost(self) -> None:
        self.transport = None
        self._segments.clear()
        self._held.clear()
        self._sent_held.clear()

    # ---------------------------------------------------------------- requests

    def _process(self) -> None:
        next_request = self._dec.next_request
        dispatch = self._dispatch
        max_reqs, max_bytes = self._max_reqs, self._max_bytes
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
        self.flush()

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
            taken = start(req.offset, view, self.fast_done, req)
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

    def fast_done(self, req: Any, cont: Any) -> None:
        """Completion of a fast-path request (see BlockStore.start_read): None finished it,
        a memoryview answers a READ from the store's own buffer, a coroutine continues it, an
        exception failed it."""
        if self._aborted:
            if cont is not None and not isinstance(cont, BaseException | memoryview):
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
            if not self._batching.after_replies(self.flush):
                self._loop.call_soon(self.flush)

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
            self._loop.call_soon(self.flush)

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
        if err not in QUIET_ERRORS:
            log.warning("%s: %r failed: %s", self.peer, req, os.strerror(err))
        self._segments.append(_PACK_REPLY(_REPLY_MAGIC, wire_error(err, req.flags), req.cookie))

    def flush(self) -> None:
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
        if t is None:
            return
        busy = (
            self._write_paused
            or self._disconnecting
            or self._in_flight >= self._max_reqs
            or self._in_flight_bytes >= self._max_bytes
        )
        if busy and not self._read_paused:
            self._read_paused = True
            t.pause_reading()
        elif not busy and self._read_paused:
            self._read_paused = False
            t.resume_reading()
            # Requests may already be complete in the decoder's buffer.
            if self._dec.buffered:
                self._loop.call_soon(self.process_if_open)

    def process_if_open(self) -> None:
        if self.transport is not None and not self._disconnecting:
            self._process()

    def _maybe_close(self) -> None:
        if self._in_flight or self.transport is None:
            return
        if self._segments:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self.flush)
            return
        self.transport.close()  # sends what is buffered, then closes


def transmission_type() -> type[Transmission]:
    """The compiled `Transmission` (duvm.node.daemon._transmission) when the compiled path runs
    here, else this one, the reference."""
    compiled = accel.load("duvm.node.daemon._transmission")
    return compiled.Transmission if compiled is not None else Transmission
