# cython: language_level=3
"""The memserver's STORE/LOAD/FREE serving loop, compiled: the twin of the loop in
`duvm.memserver.connection.Connection.buffer_updated`, which stays the reference.

`serve` serves the complete, well-formed STORE, LOAD and FREE frames at the front of the
decoder's buffer, one after another, and stops at the first frame it leaves to the reference
loop: an incomplete one, any other type, anything the decoder or the page store would refuse
(a bad header or count, a STORE beyond the reservation, a LOAD of a page not stored, a STORE or FREE from a
connection fenced off its namespace: `writable` False) and a LOAD
larger than COPY_LOAD_PAGES (the reference sends those from the arena without a copy). So
every error and refusal is produced by the reference code, with its messages and counters;
what this loop serves, it serves with the same replies, the same slots and the same counters.
Replies go to the caller's list: the small ones (STORE and FREE) gathered in one bytearray,
each LOAD reply as one bytes object with its pages copied in (built at its final size, never
grown), so no Python object is made per page besides the page-table entries.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

cdef enum:
    PAGE = 4096
    HEADER = 24
    MAGIC = 0x4D565544
    STORE = 4
    LOAD = 5
    FREE = 6
    REPLY = 0x8000
    MAX_BATCH = 1024

COPY_LOAD_PAGES = 16  # larger LOADs go out as arena views (the reference loop)


cdef inline uint32_t _u32(const unsigned char *p) noexcept:
    return p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)


cdef inline uint64_t _u64(const unsigned char *p) noexcept:
    return _u32(p) | (<uint64_t>_u32(p + 4) << 32)


cdef inline void _put32(unsigned char *p, uint32_t v) noexcept:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = (v >> 24) & 0xFF


cdef inline void _put64(unsigned char *p, uint64_t v) noexcept:
    _put32(p, <uint32_t>(v & 0xFFFFFFFF))
    _put32(p + 4, <uint32_t>(v >> 32))


cdef unsigned char *_grow(bytearray out, Py_ssize_t more) except NULL:
    """Room for `more` bytes at the end of `out` (its size grows by that much)."""
    cdef Py_ssize_t size = PyByteArray_GET_SIZE(out)
    PyByteArray_Resize(out, size + more)
    return <unsigned char *>PyByteArray_AS_STRING(out) + size


cdef void _header(unsigned char *p, uint16_t mtype, uint64_t req_id, uint32_t length) noexcept:
    _put32(p, MAGIC)
    p[4] = mtype & 0xFF
    p[5] = mtype >> 8
    p[6] = 0
    p[7] = 0
    _put64(p + 8, req_id)
    _put32(p + 16, 0)
    _put32(p + 20, length)


def serve(
    unsigned char[::1] buf not None,
    Py_ssize_t start,
    Py_ssize_t end,
    Py_ssize_t limit_store,
    Py_ssize_t limit_batch,
    dict pages not None,
    Py_ssize_t reserved,
    object arena,
    unsigned char[::1] memory not None,
    dict counters not None,
    list out not None,
    bint writable,
):
    """Serve frames from buf[start:end], appending the replies to `out`; the new start
    (== start when nothing was served).
    `limit_store` and `limit_batch` are the decoder's payload limits for STORE and for
    LOAD/FREE; `pages` and `reserved` the namespace's; `memory` the arena's bytes;
    `writable` False when a newer generation fenced the namespace (FENCE): then every STORE
    and FREE is left to the reference loop, which refuses it (FENCED)."""
    cdef const unsigned char *p
    cdef const unsigned char *keys
    cdef unsigned char *w
    cdef uint16_t mtype
    cdef uint32_t n, i, length
    cdef uint64_t req_id
    cdef Py_ssize_t slot, new, total, j
    cdef object key, got
    cdef list slots
    cdef set seen
    cdef bytearray small = bytearray()  # STORE and FREE replies since the last LOAD reply
    cdef bytes reply
    cdef long store_requests = 0, pages_stored = 0, load_requests = 0, pages_loaded = 0
    cdef long free_requests = 0, pages_freed = 0
    alloc, release = arena.alloc, arena.free
    try:
        while end - start >= HEADER:
            p = &buf[start]
            mtype = p[4] | (p[5] << 8)
            length = _u32(p + 20)
            if (
                _u32(p) != MAGIC
                or p[6] or p[7]
                or _u32(p + 16) != 0
                or not (STORE <= mtype <= FREE)
                or length > (limit_store if mtype == STORE else limit_batch)
                or end - start < HEADER + length
                or length < 8
            ):
                break  # incomplete, or the reference decides (and refuses)
            req_id = _u64(p + 8)
            n = _u32(p + 24)
            if _u32(p + 28) != 0 or n < 1 or n > MAX_BATCH:
                break
            if length != (8 + n * (8 + PAGE) if mtype == STORE else 8 + n * 8):
                break
            keys = p + 32
            if mtype != LOAD and not writable:
                break  # fenced off: the reference refuses it
            if mtype == STORE:
                slots = [pages.get(_u64(keys + 8 * i)) for i in range(n)]
                new = slots.count(None)
                if new:
                    if len(pages) + new > reserved:
                        seen = set()  # exact count (duplicate keys in the batch)
                        for i in range(n):
                            if slots[i] is None:
                                seen.add(_u64(keys + 8 * i))
                        if len(pages) + len(seen) > reserved:
                            break  # refused: the reference says so
                    for i in range(n):
                        if slots[i] is None:
                            key = _u64(keys + 8 * i)
                            got = pages.get(key)  # a key repeated in the batch: its first slot
                            if got is None:
                                got = pages[key] = alloc()
                            slots[i] = got
                for i in range(n):
                    slot = slots[i]
                    memcpy(&memory[slot * PAGE], keys + 8 * n + <Py_ssize_t>i * PAGE, PAGE)
                store_requests += 1
                pages_stored += n
                w = _grow(small, HEADER)
                _header(w, STORE | REPLY, req_id, 0)
            elif mtype == LOAD:
                if n > COPY_LOAD_PAGES:
                    break  # from the arena without a copy: the reference
                slots = [pages.get(_u64(keys + 8 * i)) for i in range(n)]
                if None in slots:
                    break  # refused (not stored): the reference says so
                total = <Py_ssize_t>n * PAGE
                reply = PyBytes_FromStringAndSize(NULL, HEADER + total)
                w = <unsigned char *>PyBytes_AS_STRING(reply)
                _header(w, LOAD | REPLY, req_id, <uint32_t>total)
                for i in range(n):
                    slot = slots[i]
                    memcpy(w + HEADER + <Py_ssize_t>i * PAGE, &memory[slot * PAGE], PAGE)
                if PyByteArray_GET_SIZE(small):
                    out.append(small)
                    small = bytearray()
                out.append(reply)
                load_requests += 1
                pages_loaded += n
            else:
                slots = []
                for i in range(n):
                    got = pages.pop(_u64(keys + 8 * i), None)
                    if got is not None:
                        slots.append(got)
                # pushed in reverse: the next new pages pop them in ascending order
                for j in range(len(slots) - 1, -1, -1):
                    release(slots[j])
                free_requests += 1
                pages_freed += len(slots)
                w = _grow(small, HEADER + 8)
                _header(w, FREE | REPLY, req_id, 8)
                _put32(w + HEADER, <uint32_t>len(slots))
                _put32(w + HEADER + 4, 0)
            start += HEADER + length
    finally:
        if PyByteArray_GET_SIZE(small):
            out.append(small)
        if store_requests:
            counters["store_requests"] += store_requests
            counters["pages_stored"] += pages_stored
        if load_requests:
            counters["load_requests"] += load_requests
            counters["pages_loaded"] += pages_loaded
        if free_requests:
            counters["free_requests"] += free_requests
            counters["pages_freed"] += pages_freed
    return start
