# cython: language_level=3
"""The transmission phase of one NBD connection in C: the compiled twin of `Transmission` in
`duvm.node.daemon.nbd_transmission`, which stays the reference and documents the rules.

Per request the reference runs four interpreted frames (dispatch, hand to the store, the
store's callback, completion) and packs each reply header with `struct`; here the connection
is a typed object whose counters and flags are C fields, the common request (a READ or a
flagless WRITE the store's fast path takes, answered without error) makes no Python call of
its own beyond the store's, and a reply header is written straight into a new bytes object.
What a request meets outside (the decoder, the pool, the store, the loop, Tasks, logging) is
the same code the reference calls; the decoder and its requests are read through their C
interface (`duvm.wire._nbdcodec`'s .pxd: a field read is a load, the next request a C call),
since the compiled path runs all its modules or none (`duvm.base.accel`).

tests/test_nbd_transmission.py holds both to the same behaviour.
"""

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from duvm.wire._nbdcodec cimport Request, TransmissionDecoder

import asyncio
import errno
import os
from functools import partial
from time import perf_counter_ns

from duvm.node.daemon.nbd_transmission import QUIET_ERRORS, log
from duvm.store.storage import StorageError
from duvm.wire import nbdconst as C
from duvm.wire.nbdproto import NbdProtocolError, wire_error

cdef uint32_t REPLY_MAGIC = C.SIMPLE_REPLY_MAGIC
cdef int CMD_READ = C.CMD_READ
cdef int CMD_WRITE = C.CMD_WRITE
cdef int CMD_FLUSH = C.CMD_FLUSH
cdef int CMD_TRIM = C.CMD_TRIM
cdef int CMD_WRITE_ZEROES = C.CMD_WRITE_ZEROES
cdef int FLAG_FUA = C.CMD_FLAG_FUA
cdef int EIO = errno.EIO


cdef inline void _be32(uint8_t *p, uint32_t v) noexcept:
    p[0] = v >> 24
    p[1] = (v >> 16) & 0xFF
    p[2] = (v >> 8) & 0xFF
    p[3] = v & 0xFF


cdef bytes _reply(uint32_t error, uint64_t cookie):
    """`C.SIMPLE_REPLY.pack(magic, error, cookie)`, written in place."""
    out = PyBytes_FromStringAndSize(NULL, 16)
    cdef uint8_t *p = <uint8_t *>PyBytes_AS_STRING(out)
    _be32(p, REPLY_MAGIC)
    _be32(p + 4, error)
    _be32(p + 8, <uint32_t>(cookie >> 32))
    _be32(p + 12, <uint32_t>cookie)
    return out


cdef class Transmission:
    """The requests of one NBD connection after its handshake (see the reference)."""

    cdef readonly object store, stats, pool
    cdef public object transport
    cdef readonly str peer
    cdef TransmissionDecoder _dec  # the compiled decoder: the compiled path runs all or none
    cdef object _loop, _batching, _start_read, _start_write, _lat, _trace
    cdef object _fast_done, _flush, _finished
    cdef Py_ssize_t _max_reqs, _max_bytes, _in_flight, _in_flight_bytes
    cdef list _segments, _held, _sent_held
    cdef bint _flush_scheduled, _read_paused, _write_paused, _disconnecting, _aborted, _timed
    cdef dict _waiting, _t0

    def __init__(self, server, transport, decoder, str peer):
        self.store = server.store
        self.stats = server.stats
        self.pool = server.pool
        self.transport = transport
        self.peer = peer
        self._dec = decoder
        self._loop = asyncio.get_running_loop()
        self._max_reqs = server.max_in_flight
        self._max_bytes = server.max_in_flight_bytes
        self._segments = []
        self._held = []
        self._sent_held = []
        self._flush_scheduled = False
        self._in_flight = 0
        self._in_flight_bytes = 0
        self._read_paused = False
        self._write_paused = False
        self._disconnecting = False
        self._aborted = False
        self._waiting = {}
        self._batching = self.store.batching
        entries = self.store.fast_entries() if self.store.fast_path else (None, None)
        self._start_read, self._start_write = entries
        self._lat = server.latency
        self._trace = server.trace
        self._timed = self._lat is not None or self._trace is not None
        self._t0 = {}
        # bound once: handed to the store and the loop per request
        self._fast_done = self.fast_done
        self._flush = self.flush
        self._finished = self.finished

    # ---------------------------------------------------------------- the transport's events

    def get_buffer(self):
        return self._dec.get_buffer()

    def received(self, Py_ssize_t nbytes):
        self._dec.buffer_updated(nbytes)
        self._process()

    def receive_data(self, data):
        self._dec.receive_data(data)
        self._process()

    def write_paused(self, bint paused):
        self._write_paused = paused
        self._update_reading()

    def finish(self):
        self._disconnecting = True
        self._update_reading()
        self._maybe_close()

    def abort(self, str reason):
        log.warning("%s: closing connection: %s", self.peer, reason)
        self._disconnecting = True
        self._aborted = True
        if self.transport is not None:
            self.transport.abort()
        waiting, self._waiting = self._waiting, {}
        for task in waiting.values():
            task.cancel()

    def lost(self):
        self.transport = None
        self._segments.clear()
        self._held.clear()
        self._sent_held.clear()

    # ---------------------------------------------------------------- requests

    cdef void _process(self) except *:
        cdef TransmissionDecoder dec = self._dec
        cdef Request req
        batching = self._batching
        corked = batching.cork()
        try:
            while not self._disconnecting:
                if self._in_flight >= self._max_reqs or self._in_flight_bytes >= self._max_bytes:
                    break
                req = dec.next_request()
                if req is None:
                    break
                self._dispatch(req)
        except NbdProtocolError as e:
            self.stats.protocol_errors += 1
            self.abort(str(e))
            return
        finally:
            if corked:
                batching.uncork()
        self._update_reading()
        self.flush()

    cdef void _dispatch(self, Request req) except *:
        cdef int cmd
        cdef Py_ssize_t n
        self.stats.requests += 1
        if req.error:
            self._reply_error(req, req.error)
            return
        cmd = req.cmd
        store = self.store
        if cmd == CMD_READ:
            n = req.length
            if not n:
                self._segments.append(_reply(0, req.cookie))
                return
            buf = self.pool.acquire(n)
            req.buffer = buf
            view = buf if len(buf) == n else buf[:n]
            req.payload = view
            self._in_flight_bytes += n
            if self._start_read is not None and self._started(self._start_read, req, view):
                return
            coro = store.read(req.offset, view)
        elif cmd == CMD_WRITE:
            n = req.length
            if not n:
                self._segments.append(_reply(0, req.cookie))
                return
            self._in_flight_bytes += n
            if (
                self._start_write is not None
                and not req.flags
                and self._started(self._start_write, req, req.payload)
            ):
                return
            coro = store.write(req.offset, req.payload)
        elif cmd == CMD_TRIM:
            coro = store.trim(req.offset, req.length)
        elif cmd == CMD_WRITE_ZEROES:
            coro = store.write_zeroes(req.offset, req.length)
        elif cmd == CMD_FLUSH:
            coro = store.flush()
        else:  # DISC
            self._disconnecting = True
            self._maybe_close()
            return
        if req.flags & FLAG_FUA and (cmd == CMD_WRITE or cmd == CMD_TRIM
                                     or cmd == CMD_WRITE_ZEROES):
            coro = _then_flush(store, coro)
        if self._timed:
            self._t0[req] = perf_counter_ns()
        self._in_flight += 1
        self._run(req, coro)

    cdef bint _started(self, start, Request req, view) except -1:
        if self._timed:
            self._t0[req] = perf_counter_ns()
        self._in_flight += 1
        try:
            taken = start(req.offset, view, self._fast_done, req)
        except Exception:
            log.exception("%s: store failed on %r", self.peer, req)
            self._done(req, EIO)
            return True
        if taken:
            if self._in_flight > self.stats.peak_in_flight:
                self.stats.peak_in_flight = self._in_flight
            return True
        self._in_flight -= 1
        self._t0.pop(req, None)
        return False

    def fast_done(self, Request req not None, cont):
        if self._aborted:
            if cont is not None and not isinstance(cont, (BaseException, memoryview)):
                cont.close()
            return
        if cont is None:
            self._done(req, 0)
        elif isinstance(cont, memoryview):
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
                self._done(req, EIO)
        else:
            self._run(req, cont)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            if not self._batching.after_replies(self._flush):
                self._loop.call_soon(self._flush)

    cdef void _run(self, req, coro) except *:
        task = self._loop.create_task(coro)
        self._waiting[req] = task
        task.add_done_callback(partial(self._finished, req))
        if self._in_flight > self.stats.peak_in_flight:
            self.stats.peak_in_flight = self._in_flight

    def finished(self, Request req not None, task):
        cdef int err
        if self._waiting.pop(req, None) is None:
            return
        if task.cancelled():
            err = EIO
        else:
            exc = task.exception()
            if exc is None:
                err = 0
            elif isinstance(exc, StorageError):
                err = exc.errno
            else:
                log.error("%s: store failed on %r", self.peer, req, exc_info=exc)
                err = EIO
        self._done(req, err)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    cdef void _done(self, Request req, int err) except *:
        cdef int cmd = req.cmd
        self._in_flight -= 1
        buf = req.buffer
        if self._timed:
            t0, t1 = self._t0.pop(req), perf_counter_ns()
            if self._lat is not None:
                self._lat.observe_ns(cmd, t1 - t0)
            if self._trace is not None:
                self._trace.record(cmd, req.offset, req.length, t0, t1, err)
        if cmd <= CMD_WRITE:
            self._in_flight_bytes -= <Py_ssize_t>req.length
        if err:
            if buf is not None:
                self.pool.release(buf)
            self._reply_error(req, err)
        elif cmd == CMD_READ:
            self._segments.append(_reply(0, req.cookie))
            self._segments.append(req.payload)
            if buf is not None:
                self._held.append(buf)
        else:
            if buf is not None:
                self.pool.release(buf)
            self._segments.append(_reply(0, req.cookie))
        req.buffer = None
        req.payload = None
        if self._read_paused:
            self._update_reading()
        if self._disconnecting:
            self._maybe_close()

    cdef void _reply_error(self, Request req, int err) except *:
        self.stats.errors += 1
        if err not in QUIET_ERRORS:
            log.warning("%s: %r failed: %s", self.peer, req, os.strerror(err))
        self._segments.append(_reply(wire_error(err, req.flags), req.cookie))

    def flush(self):
        self._flush_scheduled = False
        t = self.transport
        if t is None:
            return
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

    cdef void _update_reading(self) except *:
        t = self.transport
        if t is None:
            return
        cdef bint busy = (
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
            if self._dec.buffered:
                self._loop.call_soon(self.process_if_open)

    def process_if_open(self):
        if self.transport is not None and not self._disconnecting:
            self._process()

    cdef void _maybe_close(self) except *:
        if self._in_flight or self.transport is None:
            return
        if self._segments:
            if not self._flush_scheduled:
                self._flush_scheduled = True
                self._loop.call_soon(self._flush)
            return
        self.transport.close()


async def _then_flush(store, coro):
    await coro
    await store.flush()
