# cython: language_level=3
"""The NBD transmission phase in C: the compiled twin of `duvm.wire.nbdproto`'s
`TransmissionDecoder`, `BufferPool` and `Request`, which stay the reference and document the
rules.

The same interface and the same results: requests decoded from the same bytes, cut anywhere,
with the same fields, errors and payload bytes, and the same NbdProtocolError and UsageError
at the same points (tests/test_nbdproto.py runs its transmission tests against both, and a
differential test feeds both the same generated streams). Headers are read from the receive
buffer by pointer, payloads copied with one memcpy, and the common request (a plain, aligned,
in-range READ or WRITE) needs no Python call; the rest is validated by the reference's
`validate`, so every error decision is made in one place. The classes' fields and C methods
are declared in `_nbdcodec.pxd`, which the compiled transmission cimports.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memmove

from duvm.wire import nbdconst as C
from duvm.wire import nbdproto
from duvm.wire.nbdproto import NbdProtocolError, UsageError, allowed_flags, validate

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

cdef extern from "Python.h":
    ctypedef struct Py_buffer:
        void *buf
        Py_ssize_t len
    Py_buffer *PyMemoryView_GET_BUFFER(object mview)

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

cdef enum:
    REQ_SIZE = 28
    REQ_MAGIC = 0x25609513
    CMD_READ = 0
    CMD_WRITE = 1
    FLAG_READ_ONLY = 2
    DIRECT_BYTES = 32 << 10

assert REQ_SIZE == C.REQUEST_SIZE and REQ_MAGIC == C.REQUEST_MAGIC
assert CMD_READ == C.CMD_READ and CMD_WRITE == C.CMD_WRITE
assert FLAG_READ_ONLY == C.FLAG_READ_ONLY
assert DIRECT_BYTES == nbdproto.TransmissionDecoder.DIRECT_MIN


cdef inline uint16_t _u16(const unsigned char *p) noexcept:
    return (<uint16_t>p[0] << 8) | p[1]


cdef inline uint32_t _u32(const unsigned char *p) noexcept:
    return (<uint32_t>p[0] << 24) | (<uint32_t>p[1] << 16) | (<uint32_t>p[2] << 8) | p[3]


cdef inline uint64_t _u64(const unsigned char *p) noexcept:
    return (<uint64_t>_u32(p) << 32) | _u32(p + 4)


cdef inline char *_view_ptr(object view):
    """The first byte of a (C-contiguous, writable) memoryview."""
    return <char *>PyMemoryView_GET_BUFFER(view).buf


cdef class Request:
    """One decoded request: `nbdproto.Request`'s fields, typed."""

    def __init__(self, int cmd, int flags, uint64_t cookie, uint64_t offset, uint64_t length,
                 int error, payload=None, buffer=None):
        self.cmd = cmd
        self.flags = flags
        self.cookie = cookie
        self.offset = offset
        self.length = length
        self.error = error
        self.payload = payload
        self.buffer = buffer

    def __repr__(self):
        name = C.CMD_NAMES.get(self.cmd, str(self.cmd))
        return (
            f"Request({name} flags=0x{self.flags:x} cookie={self.cookie} "
            f"offset={self.offset} length={self.length} error={self.error})"
        )


cdef inline Request _request(int cmd, int flags, uint64_t cookie, uint64_t offset,
                             uint64_t length, int error, object payload, object buffer):
    cdef Request r = Request.__new__(Request)
    r.cmd = cmd
    r.flags = flags
    r.cookie = cookie
    r.offset = offset
    r.length = length
    r.error = error
    r.payload = payload
    r.buffer = buffer
    return r


cdef class BufferPool:
    """Reusable buffers in power-of-two size classes: `nbdproto.BufferPool`'s rules."""

    def __init__(self, Py_ssize_t keep_bytes=16 << 20, Py_ssize_t min_size=4096):
        self._keep_bytes = keep_bytes
        self._min = min_size
        self._free = {}
        self._small = self._free.setdefault(min_size, [])

    cpdef object acquire(self, Py_ssize_t n):
        """A buffer of at least `n` bytes (contents undefined)."""
        cdef Py_ssize_t size
        cdef list free
        if n <= self._min:
            if self._small:
                return self._small.pop()
            return memoryview(bytearray(self._min))
        size = 1
        while size < n:
            size <<= 1
        free = self._free.get(size)
        if free:
            return free.pop()
        return memoryview(bytearray(size))

    cpdef void release(self, object buf):
        cdef Py_ssize_t size = len(buf)
        cdef list free
        if size == self._min:
            free = self._small
        else:
            free = self._free.setdefault(size, [])
        if len(free) < ((self._keep_bytes // size) or 1) + 4:
            free.append(buf)


cdef class TransmissionDecoder:
    """Request stream -> `Request`s, validated: `nbdproto.TransmissionDecoder`'s interface."""

    DIRECT_MIN = DIRECT_BYTES

    def __init__(self, export, pool=None, Py_ssize_t buffer_size=256 << 10):
        if buffer_size < 2 * REQ_SIZE:
            raise UsageError("receive buffer too small")
        self.export = export
        self.pool = pool if pool is not None else BufferPool()
        self._pool_acquire = self.pool.acquire
        self._allowed = allowed_flags(export.flags)
        self._align = export.min_block - 1
        self._size = export.size
        self._max_payload = export.max_payload
        self._max_rw_cmd = CMD_READ if export.flags & FLAG_READ_ONLY else CMD_WRITE
        self._buf = bytearray(buffer_size)
        self._mv = memoryview(self._buf)
        self._p = <unsigned char *>PyByteArray_AS_STRING(self._buf)  # never resized
        self._cap = buffer_size
        self._start = self._end = 0
        self._pending = self._skipped = None
        self._pay = None
        self._got = self._skip = 0
        self._direct = False
        self._large_writes = False

    # -- input

    def get_buffer(self):
        """Where the next received bytes should go (never empty)."""
        cdef Py_ssize_t remaining, n
        if self._pending is not None and self._start == self._end:
            remaining = <Py_ssize_t>self._pending.length - self._got
            if remaining >= DIRECT_BYTES:
                self._direct = True
                return self._pay[self._got :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
            if self._large_writes and self._pending is None and not self._skip:
                return self._mv[:REQ_SIZE]
        elif self._cap - self._end < REQ_SIZE or self._start > self._cap // 2:
            n = self._end - self._start
            memmove(self._p, self._p + self._start, n)
            self._start, self._end = 0, n
        return self._mv[self._end :]

    def buffer_updated(self, Py_ssize_t nbytes):
        """`nbytes` were written into the view the last get_buffer() returned."""
        if self._direct:
            self._got += nbytes
            self._direct = False
        else:
            self._end += nbytes

    def receive_data(self, data):
        """Copy bytes in; as `nbdproto.TransmissionDecoder.receive_data`."""
        cdef Py_ssize_t n
        view = memoryview(data)
        while view:
            dst = self.get_buffer()
            n = min(len(dst), len(view))
            if n == 0:
                raise UsageError("receive buffer full: drain next_request() first")
            dst[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
            if view and not self._direct and self._end == self._cap:
                raise UsageError("receive buffer full: drain next_request() first")

    # -- output

    cpdef Request next_request(self):
        """The next complete request, or None when more bytes are needed; NbdProtocolError
        on a frame that puts the stream out of step (bad magic)."""
        cdef Py_ssize_t start, avail, want, n
        cdef const unsigned char *h
        cdef uint32_t magic
        cdef int flags, cmd, err
        cdef uint64_t cookie, offset, length
        cdef Request pending, skipped
        while True:
            start = self._start
            avail = self._end - start
            pending = self._pending
            if pending is not None:
                want = <Py_ssize_t>pending.length - self._got
                if avail and want:
                    n = want if want < avail else avail
                    memcpy(_view_ptr(self._pay) + self._got, self._p + start, n)
                    self._got += n
                    self._start = start + n
                    want -= n
                if want:
                    return None
                self._pending = None
                self._pay = None
                return pending
            if self._skip:
                n = self._skip if self._skip < avail else avail
                self._start += n
                self._skip -= n
                if self._skip:
                    return None
                skipped = self._skipped
                self._skipped = None
                return skipped
            if avail < REQ_SIZE:
                return None
            h = self._p + start
            magic = _u32(h)
            flags = _u16(h + 4)
            cmd = _u16(h + 6)
            cookie = _u64(h + 8)
            offset = _u64(h + 16)
            length = _u32(h + 24)
            start += REQ_SIZE
            self._start = start
            self._large_writes = cmd == CMD_WRITE and length >= DIRECT_BYTES
            if magic != REQ_MAGIC:
                raise NbdProtocolError(f"bad request magic 0x{magic:08x}")
            # Fast path: a plain aligned in-range READ or WRITE needs no further checks.
            if (
                cmd <= self._max_rw_cmd
                and not flags
                and not (offset | length) & self._align
                and offset <= self._size
                and length <= self._size - offset  # no wrap-around: offsets are u64
                and length <= self._max_payload
            ):
                if cmd == CMD_READ or not length:
                    return _request(cmd, flags, cookie, offset, length, 0, None, None)
                if avail - REQ_SIZE >= <Py_ssize_t>length:  # whole payload here: one copy
                    buf = self._pool_acquire(length)
                    pay = buf if len(buf) == length else buf[:length]
                    memcpy(_view_ptr(pay), self._p + start, length)
                    self._start = start + length
                    return _request(cmd, flags, cookie, offset, length, 0, pay, buf)
                self._await_payload(cmd, flags, cookie, offset, length)
                continue
            err = validate(self.export, self._allowed, cmd, flags, offset, length)
            if cmd != CMD_WRITE or not length:
                return _request(cmd, flags, cookie, offset, length, err, None, None)
            if err:
                # The payload follows anyway: skip it so the next request is read in step.
                self._skip = length
                self._skipped = _request(cmd, flags, cookie, offset, length, err, None, None)
                continue
            self._await_payload(cmd, flags, cookie, offset, length)

    cdef void _await_payload(self, int cmd, int flags, uint64_t cookie, uint64_t offset,
                             uint64_t length) except *:
        buf = self._pool_acquire(length)
        pay = buf if len(buf) == length else buf[:length]
        self._pay = pay
        self._got = 0
        self._pending = _request(cmd, flags, cookie, offset, length, 0, pay, buf)

    @property
    def buffered(self):
        """Bytes received but not yet turned into requests."""
        return self._end - self._start

    @property
    def mid_request(self):
        """True while a request header or payload is only partly received."""
        return bool(self._pending is not None or self._skip or self._end != self._start)
