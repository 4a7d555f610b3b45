# cython: language_level=3
"""The memory client's send side in C: the compiled twin of `SendQueue` in
`duvm.store.memclient_send`, which stays the reference and documents it.

Per request the reference queues into the open merged batch through interpreted frames, and
per frame it packs the header and keys with `struct`; here the queue is a typed object that
keeps the open batch's lists and page count in C fields, a frame's header and keys are
written straight into a new bytes object, and a STORE's part (`wire_part`) is judged on the
view's buffer in place. What a request meets outside (the `Batch` the
receive side completes, `Batching`, the loop, `fail_requests`, the encoder for the rare
non-page requests) is the reference's own code.

tests/test_memclient_send.py holds both to the same behaviour.
"""

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

from cpython.buffer cimport PyBuffer_IsContiguous
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.memoryview cimport PyMemoryView_Check, PyMemoryView_GET_BUFFER
from cpython.ref cimport PyObject
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

import dataclasses

from duvm.store.memclient_replies import Batch, callback_type, fail_requests
from duvm.store.memclient_send import CORKED, LOAD, MERGE_PAGES, STORE
from duvm.store.memserver_errors import MemserverUnreachable
from duvm.wire import pageproto as pp
from duvm.wire.pageencode import batch_prefix, encode

cdef uint32_t MAGIC = pp.MAGIC
cdef Py_ssize_t PAGE = pp.PAGE_SIZE
cdef int C_STORE = STORE
cdef int C_LOAD = LOAD
cdef Py_ssize_t C_MERGE = MERGE_PAGES
cdef Py_ssize_t PREFIX = 32  # header (24) and the batch head: count and reserved (8)


cdef inline void _u16(uint8_t *p, uint16_t v) noexcept:
    p[0] = v & 0xFF
    p[1] = v >> 8


cdef inline void _u32(uint8_t *p, uint32_t v) noexcept:
    cdef int i
    for i in range(4):
        p[i] = (v >> (8 * i)) & 0xFF


cdef inline void _u64(uint8_t *p, uint64_t v) noexcept:
    cdef int i
    for i in range(8):
        p[i] = (v >> (8 * i)) & 0xFF


cdef inline double _monotonic() noexcept:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)  # what time.monotonic() reads
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef extern from *:
    """
    static PyObject *duvm_view_exporter(Py_buffer *view) { return view->obj; }
    """
    PyObject *duvm_view_exporter(Py_buffer *view)  # NULL for a view of raw memory


cdef inline object _wire_part(object data):
    """`memclient_send.wire_part`: the bytes object a C-contiguous view covers whole, else
    `data` itself."""
    cdef Py_buffer *view
    cdef PyObject *obj
    if PyMemoryView_Check(data):
        view = PyMemoryView_GET_BUFFER(data)
        obj = duvm_view_exporter(view)
        if (
            obj != NULL
            and PyBytes_Check(<object>obj)
            and PyBuffer_IsContiguous(view, b"C")
            and view.len == PyBytes_GET_SIZE(<object>obj)
        ):
            return <object>obj
    return data


cdef bytes _prefix(int mtype, uint64_t req_id, list keys):
    """`pageencode.batch_prefix`, written in place (its checks: the reference's, on a key
    that is not a valid page number)."""
    cdef Py_ssize_t n = len(keys), i
    cdef uint64_t k
    out = PyBytes_FromStringAndSize(NULL, PREFIX + 8 * n)
    cdef uint8_t *p = <uint8_t *>PyBytes_AS_STRING(out)
    _u32(p, MAGIC)
    _u16(p + 4, <uint16_t>mtype)
    _u16(p + 6, 0)
    _u64(p + 8, req_id)
    _u32(p + 16, 0)
    if mtype == C_STORE:
        _u32(p + 20, <uint32_t>(8 + n * (8 + PAGE)))
    else:
        _u32(p + 20, <uint32_t>(8 + n * 8))
    _u32(p + 24, <uint32_t>n)
    _u32(p + 28, 0)
    try:
        for i in range(n):
            k = keys[i]
            _u64(p + PREFIX + 8 * i, k)
    except (OverflowError, TypeError):
        return batch_prefix(mtype, req_id, keys)  # raises what the reference raises
    return out


cdef class SendQueue:
    """The requests of one memory client on their way out (see the reference)."""

    cdef public dict pending
    cdef public Py_ssize_t max_batch
    cdef public double busy_since
    cdef public object transport
    cdef readonly str peer
    cdef readonly object batching
    cdef object _loop, _flush_handle, _callback, _send
    cdef object _open  # the open Batch; its lists and page count below
    cdef list _open_keys, _open_parts, _open_waiters, _outq
    cdef int _open_mtype
    cdef Py_ssize_t _open_count
    cdef uint64_t _next_id

    def __init__(self, str peer, batching):
        self.peer = peer
        self.batching = batching
        self.pending = {}
        self.max_batch = pp.MAX_BATCH
        self.busy_since = 0.0
        self.transport = None
        self._loop = None
        self._open = None
        self._outq = []
        self._next_id = 0
        self._flush_handle = None
        self._callback = callback_type()
        self._send = self.send_queued  # bound once: the loop is handed it once per flush

    def connected(self, loop, transport):
        self._loop, self.transport = loop, transport

    def disconnected(self):
        self.transport = None

    @property
    def idle(self):
        return self._flush_handle is None and not self._outq

    cdef inline void _schedule(self) except *:
        if self._flush_handle is None:
            if self.batching.hold(self):
                self._flush_handle = CORKED
            else:
                self._flush_handle = self._loop.call_soon(self._send)

    cdef inline void _page(self, int mtype, keys, data, out, fut) except *:
        cdef Py_ssize_t n = len(keys)
        cdef Py_ssize_t limit = self.max_batch if self.max_batch < C_MERGE else C_MERGE
        if not self.pending:  # the stall watchdog measures from here
            self.busy_since = _monotonic()
        if self._open is None or self._open_mtype != mtype or self._open_count + n > limit:
            b = Batch(mtype)
            self._open = b
            self._open_mtype = mtype
            self._open_count = 0
            self._open_keys, self._open_parts, self._open_waiters = b.keys, b.parts, b.waiters
            self._outq.append(b)
        self._open_keys.extend(keys)
        self._open_count += n
        if data is not None:
            self._open_parts.append(_wire_part(data))
        self._open_waiters.append((fut, keys, data, out))
        self._schedule()

    def queue(self, int mtype, keys, data, out, msg=None, fut=None):
        loop = self._loop
        assert loop is not None, "queued before the connection was made"
        if fut is None:
            fut = loop.create_future()
        if mtype == C_STORE or mtype == C_LOAD:
            assert keys is not None
            self._page(mtype, keys, data, out, fut)
            return fut
        if not self.pending:
            self.busy_since = _monotonic()
        self._next_id += 1
        self.pending[self._next_id] = fut
        if msg is not None:
            self._outq += encode(dataclasses.replace(msg, req_id=self._next_id))
        else:
            assert keys is not None
            self._outq.append(batch_prefix(mtype, self._next_id, keys))
        self._open = None
        self._schedule()
        return fut

    def store_cb(self, keys, data, cb):
        self._page(C_STORE, keys, data, None, self._callback(cb))

    def load_cb(self, keys, out, cb):
        self._page(C_LOAD, keys, None, out, self._callback(cb))

    def resend_each(self, batch):
        for fut, keys, data, out in batch.waiters:
            if fut.done():
                continue
            solo = Batch(batch.mtype)
            solo.keys += keys
            if data is not None:
                solo.parts.append(_wire_part(data))
            solo.waiters.append((fut, keys, data, out))
            self._outq.append(solo)
        self._open = None
        if self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_soon(self._send)

    def send_queued(self):
        cdef list q, wire
        cdef dict pending
        self._flush_handle = None
        self._open = None
        q, self._outq = self._outq, []
        if not q:
            return
        t = self.transport
        if t is None or t.is_closing():
            err = MemserverUnreachable(f"not connected to memserver {self.peer}")
            if t is None and self.pending:
                # see the reference: requests queued after the lost connection failed its table
                q = [*q, *self.pending.values()]
                self.pending = {}
            fail_requests(q, err)
            return
        wire = []
        pending = self.pending
        for item in q:
            if isinstance(item, Batch):
                self._next_id += 1
                pending[self._next_id] = item
                wire.append(_prefix(item.mtype, self._next_id, item.keys))
                parts = item.parts
                if parts:
                    wire += parts
            else:
                wire.append(item)
        t.writelines(wire)

    def flush(self):
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self.send_queued()

    def fail_all(self, err):
        self.transport = None
        failed = [*self.pending.values(), *self._outq]
        self.pending = {}
        self._outq = []
        self._open = None
        fail_requests(failed, err)
