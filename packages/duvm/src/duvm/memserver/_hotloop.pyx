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
grown), so no Python object is made per page.

`PageIndex` is the compiled twin of `duvm.memserver.pageindex.PageIndex` (the reference says
how the table works): the same open-addressing table in C memory, which `serve` probes without
a Python call per page.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from posix.mman cimport (
    MAP_ANONYMOUS, MAP_FAILED, MAP_POPULATE, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap
)

from collections.abc import MutableMapping

from duvm.memserver.pageindex import EMPTY as _EMPTY_PY
from duvm.memserver.pageindex import GOLDEN as _GOLDEN_PY
from duvm.memserver.pageindex import IndexFull, buckets_for

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


cdef extern from *:
    ctypedef unsigned long long uint128 "unsigned __int128"

cdef uint32_t EMPTY = _EMPTY_PY
cdef uint64_t GOLDEN = _GOLDEN_PY


cdef class IndexCore:
    """The table of `PageIndex` (below) in C memory: see the reference for the rules."""

    cdef uint64_t *keys
    cdef uint32_t *slots
    cdef Py_ssize_t size, count, cap

    def __cinit__(self, Py_ssize_t capacity=0):
        self.keys = NULL
        self.slots = NULL
        self.size = self.count = self.cap = 0

    def __init__(self, Py_ssize_t capacity=0):
        self.resize(capacity)

    def __dealloc__(self):
        if self.size:
            munmap(self.keys, self.size * 12)

    @property
    def capacity(self):
        return self.cap

    @property
    def nbytes(self):
        return self.size * 12

    def resize(self, Py_ssize_t capacity):
        if capacity < self.count:
            raise ValueError(f"{self.count} entries do not fit a capacity of {capacity}")
        cdef Py_ssize_t size = buckets_for(capacity)
        cdef uint64_t *old_keys = self.keys
        cdef uint32_t *old_slots = self.slots
        cdef Py_ssize_t old_size = self.size, old_cap = self.cap, i
        self.cap = capacity
        if size == old_size:
            return
        cdef uint64_t *keys = NULL
        cdef uint32_t *slots = NULL
        cdef void *m
        if size:  # as the reference's `table`: its own mapping, faulted in and written now
            m = mmap(
                NULL, size * 12, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0,
            )
            if m == MAP_FAILED:
                self.cap = old_cap
                raise MemoryError(f"cannot map a page index of {size * 12} bytes")
            memset(m, 0xFF, size * 12)
            keys = <uint64_t *>m
            slots = <uint32_t *>(keys + size)
        self.keys, self.slots, self.size, self.count = keys, slots, size, 0
        for i in range(old_size):
            if old_slots[i] != EMPTY:
                self.put(old_keys[i], old_slots[i])
        if old_size:
            munmap(old_keys, old_size * 12)

    cdef inline Py_ssize_t home(self, uint64_t key) noexcept:
        return <Py_ssize_t>((<uint128>(key * GOLDEN) * <uint128>self.size) >> 64)

    cdef inline Py_ssize_t find(self, uint64_t key) noexcept:
        """The bucket holding `key`, else -1."""
        if not self.count:
            return -1
        cdef Py_ssize_t i = self.home(key)
        while self.slots[i] != EMPTY:
            if self.keys[i] == key:
                return i
            i = i + 1 if i + 1 < self.size else 0
        return -1

    cdef int put(self, uint64_t key, uint32_t slot) except -1:
        cdef Py_ssize_t i
        if self.cap:
            i = self.home(key)
            while self.slots[i] != EMPTY:
                if self.keys[i] == key:
                    self.slots[i] = slot
                    return 0
                i = i + 1 if i + 1 < self.size else 0
            if self.count < self.cap:
                self.keys[i] = key
                self.slots[i] = slot
                self.count += 1
                return 0
        raise IndexFull(f"the index holds its capacity of {self.cap} pages")

    cdef void remove_at(self, Py_ssize_t i) noexcept:
        cdef Py_ssize_t j = i, h
        while True:
            j = j + 1 if j + 1 < self.size else 0
            if self.slots[j] == EMPTY:
                break
            h = self.home(self.keys[j])
            if (i < h <= j) if i <= j else (i < h or h <= j):
                continue
            self.keys[i] = self.keys[j]
            self.slots[i] = self.slots[j]
            i = j
        self.slots[i] = EMPTY
        self.count -= 1

    def get(self, key, default=None):
        cdef Py_ssize_t i = self.find(key) if 0 <= key < 2**64 else -1
        return default if i < 0 else self.slots[i]

    def __getitem__(self, key):
        cdef Py_ssize_t i = self.find(key) if 0 <= key < 2**64 else -1
        if i < 0:
            raise KeyError(key)
        return self.slots[i]

    def __contains__(self, key):
        return isinstance(key, int) and 0 <= key < 2**64 and self.find(key) >= 0

    def __setitem__(self, key, slot):
        if not 0 <= key < 2**64 or not 0 <= slot < EMPTY:
            raise ValueError(f"key {key} or slot {slot} out of range")
        self.put(key, slot)

    def __delitem__(self, key):
        cdef Py_ssize_t i = self.find(key) if 0 <= key < 2**64 else -1
        if i < 0:
            raise KeyError(key)
        self.remove_at(i)

    def pop(self, key, *default):
        cdef Py_ssize_t i = self.find(key) if 0 <= key < 2**64 else -1
        if i < 0:
            if default:
                return default[0]
            raise KeyError(key)
        slot = self.slots[i]
        self.remove_at(i)
        return slot

    def __len__(self):
        return self.count

    def __iter__(self):
        return iter([self.keys[i] for i in range(self.size) if self.slots[i] != EMPTY])

    def items(self):
        return iter(
            [(self.keys[i], self.slots[i]) for i in range(self.size) if self.slots[i] != EMPTY]
        )

    def values(self):
        return [self.slots[i] for i in range(self.size) if self.slots[i] != EMPTY]

    def clear(self):
        if self.count:
            memset(self.slots, 0xFF, self.size * 4)
            self.count = 0

    def insert_run(self, uint64_t first_key, uint32_t first_slot, Py_ssize_t n):
        cdef Py_ssize_t i
        for i in range(n):
            self.put(first_key + i, first_slot + i)

    def update_from(self, pairs):
        for key, slot in pairs:
            self[key] = slot

    def __repr__(self):
        return f"PageIndex({dict(self.items())!r}, capacity={self.cap})"


class PageIndex(IndexCore, MutableMapping):
    """The compiled twin of `duvm.memserver.pageindex.PageIndex`."""

    __slots__ = ()


def serve(
    unsigned char[::1] buf not None,
    Py_ssize_t start,
    Py_ssize_t end,
    Py_ssize_t limit_store,
    Py_ssize_t limit_batch,
    IndexCore pages not None,
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
    cdef Py_ssize_t new, total, b
    cdef uint32_t slots[MAX_BATCH]
    cdef uint32_t freed
    cdef uint64_t key
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
                new = 0
                for i in range(n):
                    b = pages.find(_u64(keys + 8 * i))
                    if b < 0:
                        slots[i] = EMPTY
                        new += 1
                    else:
                        slots[i] = pages.slots[b]
                if new:
                    if pages.count + new > reserved:
                        seen = set()  # exact count (duplicate keys in the batch)
                        for i in range(n):
                            if slots[i] == EMPTY:
                                seen.add(_u64(keys + 8 * i))
                        if pages.count + len(seen) > reserved:
                            break  # refused: the reference says so
                    for i in range(n):
                        if slots[i] == EMPTY:
                            key = _u64(keys + 8 * i)
                            b = pages.find(key)  # a key repeated in the batch: its first slot
                            if b < 0:
                                slots[i] = alloc()
                                pages.put(key, slots[i])
                            else:
                                slots[i] = pages.slots[b]
                for i in range(n):
                    memcpy(
                        &memory[<Py_ssize_t>slots[i] * PAGE],
                        keys + 8 * n + <Py_ssize_t>i * PAGE,
                        PAGE,
                    )
                store_requests += 1
                pages_stored += n
                w = _grow(small, HEADER)
                _header(w, STORE | REPLY, req_id, 0)
            elif mtype == LOAD:
                if n > COPY_LOAD_PAGES:
                    break  # from the arena without a copy: the reference
                for i in range(n):
                    b = pages.find(_u64(keys + 8 * i))
                    if b < 0:
                        break
                    slots[i] = pages.slots[b]
                if b < 0:
                    break  # refused (not stored): the reference says so
                total = <Py_ssize_t>n * PAGE
                reply = PyBytes_FromStringAndSize(NULL, HEADER + total)
                w = <unsigned char *>PyBytes_AS_STRING(reply)
                _header(w, LOAD | REPLY, req_id, <uint32_t>total)
                for i in range(n):
                    memcpy(
                        w + HEADER + <Py_ssize_t>i * PAGE,
                        &memory[<Py_ssize_t>slots[i] * PAGE],
                        PAGE,
                    )
                if PyByteArray_GET_SIZE(small):
                    out.append(small)
                    small = bytearray()
                out.append(reply)
                load_requests += 1
                pages_loaded += n
            else:
                freed = 0
                for i in range(n):
                    b = pages.find(_u64(keys + 8 * i))
                    if b >= 0:
                        slots[freed] = pages.slots[b]
                        freed += 1
                        pages.remove_at(b)
                # pushed in reverse: the next new pages pop them in ascending order
                for i in range(freed):
                    release(slots[freed - 1 - i])
                free_requests += 1
                pages_freed += freed
                w = _grow(small, HEADER + 8)
                _header(w, FREE | REPLY, req_id, 8)
                _put32(w + HEADER, freed)
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
