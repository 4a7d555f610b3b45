# cython: language_level=3
"""The slab table in C: the compiled twin of `SlabTable` in `duvm.store.slab_table`, which
stays the reference and documents the rules.

Per replicated write the reference runs three interpreted frames of bookkeeping
(`write_started`, `mark_stored`, `write_ended`) and per read one (`bad_pages`); here the table
is a typed object whose geometry and write tokens are C fields, and those calls, with the
one-page checksum compare, run without an interpreted frame. The page tables themselves
(`state`, `crc`) stay the objects the reference holds (a bytearray and an array, or the
persisted mappings), indexed through their own item access: no buffer of theirs is held
here, so a persisted mapping can always be closed. Everything rare is the reference's code,
compiled as it is.

tests/test_slab_table.py runs its tests against both, and a differential test drives both
with the same operations.
"""

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

from array import array

from crc32c import crc32c as crc32

from duvm.store.slab_table import TableCounters, keep_trimmed, page_crcs
from duvm.store.storage import DATA, EMPTY, LOST

cdef int C_DATA = DATA
cdef int C_LOST = LOST
cdef bytes ONE_DATA = bytes((DATA,))
cdef bytes ONE_LOST = bytes((LOST,))


cdef class SlabTable:
    """Pages, slabs and replica sets of one export (see the reference)."""

    cdef readonly Py_ssize_t pages, slab_pages, nslabs
    cdef readonly tuple clients
    cdef readonly object counters
    cdef public object state, crc, sets, slab_clients, inflight, pending_writes, trims
    cdef public object on_change, on_placement_change
    cdef Py_ssize_t _next_token

    def __init__(self, Py_ssize_t pages, Py_ssize_t slab_pages, clients, tables=None):
        self.pages = pages
        self.slab_pages = slab_pages
        self.nslabs = (pages + slab_pages - 1) // slab_pages  # C division: round up by hand
        self.clients = tuple(clients)
        self.counters = TableCounters()
        self.state = bytearray(pages)
        self.crc = array("I", bytes(4 * pages))
        if tables is not None:
            if len(tables[0]) != pages or len(tables[1]) != pages:
                raise ValueError(f"page tables must have {pages} entries")
            self.state, self.crc = tables
        self.sets = []
        self.slab_clients = []
        self.inflight = array("i", bytes(4 * self.nslabs))
        self.pending_writes = {}
        self._next_token = 0
        self.trims = {}
        self.on_change = None
        self.on_placement_change = None

    # --- geometry ---

    def slab_size(self, Py_ssize_t slab):
        return min(self.slab_pages, self.pages - slab * self.slab_pages)

    def runs(self, Py_ssize_t first, Py_ssize_t count):
        cdef Py_ssize_t sp = self.slab_pages, end = first + count, slab, stop
        while first < end:
            slab = first // sp
            stop = min(end, (slab + 1) * sp)
            yield slab, first, stop - first
            first = stop

    # --- replica sets ---

    def assign(self, placement):
        self.sets = [list(p) for p in placement]
        self.slab_clients = [tuple(self.clients[i] for i in s) for s in self.sets]

    def set_replicas(self, Py_ssize_t slab, members):
        self.sets[slab] = members
        self.slab_clients[slab] = tuple(self.clients[i] for i in members)
        if self.on_placement_change is not None:
            self.on_placement_change()

    def degraded_slabs(self, int replicas):
        return [s for s, m in enumerate(self.sets) if len(m) < replicas]

    def pages_per_peer(self):
        out = [0] * len(self.clients)
        sp, st = self.slab_pages, self.state
        for s, members in enumerate(self.sets):
            n = st.count(DATA, s * sp, (s + 1) * sp)
            if n:
                for i in members:
                    out[i] += n
        return out

    # --- page state ---

    def mark_stored(self, Py_ssize_t first, Py_ssize_t count, data, crcs):
        if self.on_change is not None:
            self.on_change(first, count)
        if count == 1:
            self.crc[first] = crc32(data)
            self.state[first] = C_DATA
        else:
            self.crc[first : first + count] = page_crcs(data, count) if crcs is None else crcs
            self.state[first : first + count] = ONE_DATA * count
        if self.trims:
            keep_trimmed(self, first, count)

    def record(self, Py_ssize_t first, Py_ssize_t count, crcs):
        cdef Py_ssize_t k
        if self.on_change is not None:
            self.on_change(first, count)
        st, crc = self.state, self.crc
        for k in range(count):
            crc[first + k] = crcs[k]
            st[first + k] = C_DATA
        if self.trims:
            keep_trimmed(self, first, count)

    def mark_lost(self, Py_ssize_t first, Py_ssize_t count):
        cdef Py_ssize_t p
        if self.on_change is not None:
            self.on_change(first, count)
        st = self.state
        for p in range(first, first + count):
            if st[p] == C_DATA:
                st[p] = C_LOST
                self.counters.pages_lost += 1

    def mark_in_doubt(self, Py_ssize_t first, Py_ssize_t count):
        if self.on_change is not None:
            self.on_change(first, count)
        self.state[first : first + count] = ONE_LOST * count

    def write_failed(self, Py_ssize_t first, Py_ssize_t count):
        if self.on_change is not None:
            self.on_change(first, count)
        self.state[first : first + count] = ONE_LOST * count
        self.counters.pages_lost += count

    def clear(self, Py_ssize_t first, Py_ssize_t count):
        if self.on_change is not None:
            self.on_change(first, count)
        self.state[first : first + count] = bytes(count)

    def trim_started(self, Py_ssize_t first, Py_ssize_t count):
        self.clear(first, count)
        self._next_token += 1
        self.trims[self._next_token] = (first, count)
        return self._next_token

    def trim_ended(self, token):
        del self.trims[token]

    def forget(self):
        self.state = bytearray(self.pages)

    def trimmed_slabs(self, Py_ssize_t first, Py_ssize_t count):
        st, end = self.state, first + count
        slabs = {}
        p = first
        while p < end:
            q = st.find(EMPTY, p, end)
            q = end if q < 0 else q
            for slab, s, n in self.runs(p, q - p):
                slabs.setdefault(slab, []).extend(range(s, s + n))
            if q == end:
                break
            q2 = [x for x in (st.find(DATA, q, end), st.find(LOST, q, end)) if x >= 0]
            p = min(q2) if q2 else end
        return slabs

    # --- checking loaded bytes ---

    def write_started(self, Py_ssize_t first, Py_ssize_t count, data):
        self._next_token += 1
        self.pending_writes[self._next_token] = (first, count, data)
        return self._next_token

    def write_ended(self, token):
        del self.pending_writes[token]

    def bad_pages(self, Py_ssize_t first, Py_ssize_t count, out):
        cdef Py_ssize_t k
        crc, st = self.crc, self.state
        if count == 1:
            bad = [first] if st[first] == C_DATA and crc32(out) != crc[first] else []
        else:
            got = page_crcs(out, count)
            if got == crc[first : first + count]:
                return []
            bad = [
                first + k
                for k in range(count)
                if st[first + k] == C_DATA and got[k] != crc[first + k]
            ]
        if bad and self.pending_writes:
            bad = [
                p
                for p in bad
                if not self._in_flight_bytes(p, out[(p - first) << 12 : (p - first + 1) << 12])
            ]
        return bad

    cdef bint _in_flight_bytes(self, Py_ssize_t page, got) except -1:
        for f, n, d in self.pending_writes.values():
            if f <= page < f + n and got == d[(page - f) << 12 : (page - f + 1) << 12]:
                return True
        return False

    def pages_match(self, Py_ssize_t first, Py_ssize_t count, buf):
        if self.state.count(DATA, first, first + count) != count:
            return False
        return not self.bad_pages(first, count, buf)
