# cython: language_level=3
"""The replicated read's fast path in C: the compiled twin of `ReadFastPath` in
`duvm.store.remote_read` (its `start_read` and the completion `loaded`), which stays the
reference and documents them.

Per read the reference runs the checks and the completion as interpreted frames over a
closure; here they are C over one `LoadedRead`. What they touch outside (the slab table's
state and `bad_pages`, the readahead, the memory client's `load_cb`, the general path
`RemoteReads.load_verified`) is the reference's own code, so every rule stays in one place.

tests/test_remote_read_path.py holds both to the same behaviour.
"""

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

import logging

from duvm.store.replica_errors import REPLICA_FAILURES
from duvm.store.storage import DATA

log = logging.getLogger("duvm.store.remote_read")  # the reference's logger

cdef enum:
    PAGE_SHIFT = 12
    MASK = 4095


cdef class LoadedRead:
    """One read waiting for its LOAD: called with None (loaded) or the failure, as the
    reference's `loaded` is."""

    cdef ReadFastPath path
    cdef object out, done, tag
    cdef Py_ssize_t slab, first, count

    def __call__(self, exc):
        cdef bint ok
        reads = self.path.reads
        try:
            ok = exc is None and not self.path.table.bad_pages(self.first, self.count, self.out)
        except Exception as e:  # never leave the request unanswered
            ok, exc = False, e
        if ok:
            counters = reads.counters
            counters.loads += 1
            counters.pages_loaded += self.count
            self.done(self.tag, None)
        elif exc is None or isinstance(exc, REPLICA_FAILURES):
            self.done(self.tag, reads.load_verified(self.slab, self.first, self.count, self.out))
        else:
            self.done(self.tag, exc)


cdef class ReadFastPath:
    """The fast path of `RemoteReads` (see the reference)."""

    cdef readonly object reads, replication, table

    def __init__(self, reads):
        self.reads = reads
        self.replication = reads.replication
        self.table = reads.table

    def start_read(self, Py_ssize_t offset, out, done, tag):
        cdef Py_ssize_t n = len(out)
        cdef Py_ssize_t first, count, slab, sp
        cdef LoadedRead r
        assert not (offset | n) & MASK, f"unaligned request ({offset}, {n})"
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if not self.replication.open:
            return False
        t = self.table
        first, count = offset >> PAGE_SHIFT, n >> PAGE_SHIFT
        st = t.state
        sp = t.slab_pages
        slab = first // sp
        if count == 1:
            if st[first] != DATA:
                return False
        elif (first + count - 1) // sp != slab or st.count(DATA, first, first + count) != count:
            return False
        c = t.slab_clients[slab][0]
        if count > 1 and count > c.max_batch:  # at least 1: a one-page read fits, unasked
            return False
        ra = self.reads.readahead
        if ra.windows and ra.hit(first, count, out, done, tag):
            return True
        r = LoadedRead.__new__(LoadedRead)
        r.path, r.out, r.done, r.tag = self, out, done, tag
        r.slab, r.first, r.count = slab, first, count
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        if not c.load_cb(keys, out, r):
            return False
        try:  # the request is on its way: fetching ahead must not fail it
            ra.missed(first, count)
        except Exception:
            log.exception("readahead failed; reading on without it")
        return True
