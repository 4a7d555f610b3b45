# cython: language_level=3
"""The memory client's reply path in C: the compiled twin of `Callback` and of the common case
of `ReplyProtocol._deliver` in `duvm.store.memclient_replies`, which stay the reference and
document them.

- `Callback`: two are made and completed per replicated 4 KiB write; completing one is a C
  call into the caller's function instead of two interpreted frames. It is final (no
  subclass can change what `done` and `set_result` do), so `deliver` completes one through
  its C method, without a method call for `done` and another for `set_result`.
- `deliver` completes the plain replies at the front of the receive buffer: a STORE reply, or
  a LOAD reply of exactly its pages, with no error status, to a merged `Batch`. It stops at
  the first frame it leaves to the reference loop: an incomplete one, any other type, an error
  status, a header the decoder would refuse, an id that is not a pending Batch, a LOAD reply
  of the wrong size. So every error and refusal is handled by the reference code, and what this
  loop delivers, it delivers as the reference does: the pages copied into each caller's
  buffer, each waiter not yet done completed with None, in order.

tests/test_memclient_callback.py and tests/test_memclient_replies_hot.py hold both to the same
behaviour.
"""

cimport cython
from cpython.buffer cimport PyBuffer_IsContiguous
from cpython.memoryview cimport PyMemoryView_Check, PyMemoryView_GET_BUFFER
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

cdef enum:
    PAGE = 4096
    HEADER = 24
    MAGIC = 0x4D565544
    STORE_REPLY = 0x8004
    LOAD_REPLY = 0x8005

from duvm.store.memclient_replies import Batch, log  # the reference's batch type and logger


@cython.final
cdef class Callback:
    """Stands in for a Future on the callback fast path: completing it calls `cb(None)` or
    `cb(exception)` at once, from the receive path."""

    cdef public object cb
    cdef public bint finished

    def __init__(self, cb):
        self.cb = cb
        self.finished = False

    def done(self):
        return self.finished

    def set_result(self, _):
        self._call(None)

    def set_exception(self, exc):
        self._call(exc)

    cdef void _call(self, exc) noexcept:
        self.finished = True
        try:
            self.cb(exc)
        except Exception:  # a caller's bug must not break this connection's other replies
            log.exception("memserver request callback failed")


cdef inline uint32_t _u32(const unsigned char *p) noexcept:
    return p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _u64(const unsigned char *p) noexcept:
    return _u32(p) | (<uint64_t>_u32(p + 4) << 32)


def deliver(decoder, dict pending not None, Py_ssize_t load_limit):
    """Complete the plain replies at the front of `decoder`'s window (see the module doc),
    consuming each frame as it is delivered; the number delivered. `pending` is the owner's
    table, `load_limit` the decoder's LOAD reply limit."""
    cdef unsigned char[::1] buf
    cdef const unsigned char *p
    cdef Py_ssize_t start, end, total, off, n
    cdef uint16_t mtype
    cdef uint32_t length
    cdef uint64_t req_id
    cdef Py_ssize_t delivered = 0
    cdef list waiters
    cdef tuple w
    cdef Py_buffer *view
    cdef bint plain
    whole, start, end = decoder.window()
    buf = whole
    try:
        while end - start >= HEADER:
            p = &buf[start]
            mtype = p[4] | (p[5] << 8)
            length = _u32(p + 20)
            if (
                _u32(p) != MAGIC
                or p[6] or p[7]
                or _u32(p + 16) != 0
                or not (mtype == STORE_REPLY and length == 0
                        or mtype == LOAD_REPLY and length <= load_limit)
            ):
                break
            total = HEADER + length
            if end - start < total:
                break
            req_id = _u64(p + 8)
            entry = pending.get(req_id)
            if not isinstance(entry, Batch):
                break
            waiters = entry.waiters
            if mtype == LOAD_REPLY:
                if length != len(entry.keys) * PAGE:
                    break
                plain = True  # every caller's buffer a writable, contiguous memoryview
                for w in waiters:
                    out = w[3]
                    if not PyMemoryView_Check(out):
                        plain = False
                        break
                    view = PyMemoryView_GET_BUFFER(out)
                    if view.readonly or not PyBuffer_IsContiguous(view, b"C"):
                        plain = False
                        break
                if not plain:
                    break
            del pending[req_id]
            start += total
            if mtype == STORE_REPLY:
                for w in waiters:
                    fut = w[0]
                    if isinstance(fut, Callback):  # its done() and set_result(), in C
                        if not (<Callback>fut).finished:
                            (<Callback>fut)._call(None)
                    elif not fut.done():
                        fut.set_result(None)
            else:
                off = HEADER
                for w in waiters:
                    fut, out = w[0], w[3]
                    n = PyMemoryView_GET_BUFFER(out).len
                    if isinstance(fut, Callback):
                        if not (<Callback>fut).finished:
                            memcpy(PyMemoryView_GET_BUFFER(out).buf, p + off, n)
                            (<Callback>fut)._call(None)
                    elif not fut.done():
                        memcpy(PyMemoryView_GET_BUFFER(out).buf, p + off, n)
                        fut.set_result(None)
                    off += n
            delivered += 1
    finally:
        if delivered:
            decoder.consume(start)
    return delivered
