# cython: language_level=3
"""The replicated write's fast path in C: the compiled twin of `WriteFanOut` in
`duvm.store.remote_write` (its `start_write` and the per-replica completion `stored`), which
stays the reference and documents them.

Per replicated 4 KiB write the reference runs the fan-out, the choice of replicas and one
completion per replica as interpreted frames over a closure; here they are typed C over one
`ReplicatedWrite`, with the slab's in-flight counter written through a typed view of the
table's array. What they touch outside (the table's `mark_stored`, `write_started` and
`write_ended`, each memory client's send queue, or its `store_cb` over RDMA, the general
path `RemoteWrites.store_slab`) is the same code the reference calls, so every rule stays in
one place.

tests/test_remote_write_fanout.py holds both to the same behaviour.
"""

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

from duvm.store.memserver_errors import MemserverUnreachable
from duvm.store.replica_errors import REPLICA_FAILURES, refused_everywhere

cdef enum:
    PAGE_SHIFT = 12
    MASK = 4095


cdef class ReplicatedWrite:
    """One replicated write waiting for its STOREs: called once per replica with None
    (stored) or the failure, as the reference's `stored` is; the last call finishes it."""

    cdef WriteFanOut owner
    cdef object data, done, tag, crcs, token
    cdef list failures
    cdef Py_ssize_t slab, first, count, waiting, replicas

    def compute_crcs(self):
        self.crcs = self.owner.page_crcs(self.data, self.count)

    def __call__(self, exc):
        if exc is not None:
            if self.failures is None:
                self.failures = []
            self.failures.append(exc)
        self.waiting -= 1
        if not self.waiting:
            self._finish()

    cdef _finish(self):
        cdef WriteFanOut owner = self.owner
        owner.inflight[self.slab] -= 1
        t, w = owner.table, owner.writes
        if self.token is not None:
            t.write_ended(self.token)
        done, tag = self.done, self.tag
        if self.failures is None:
            try:
                t.mark_stored(self.first, self.count, self.data, self.crcs)
            except Exception as e:  # never leave the request unanswered
                done(tag, e)
                return
            counters = owner.counters
            counters.stores += 1
            counters.pages_stored += self.count
            done(tag, None)
        elif all(isinstance(e, REPLICA_FAILURES) for e in self.failures):
            if not refused_everywhere(self.failures, self.replicas):
                try:  # it may have reached a replica: EIO until the general path decides
                    t.mark_in_doubt(self.first, self.count)
                except Exception as e:  # never leave the request unanswered
                    done(tag, e)
                    return
            done(tag, w.store_slab(self.slab, self.first, self.count, self.data))
        else:
            done(tag, next(e for e in self.failures if not isinstance(e, REPLICA_FAILURES)))


cdef class WriteFanOut:
    """The fast path of `RemoteWrites` (see the reference)."""

    cdef readonly object writes, replication, table, page_crcs
    cdef object counters  # the writes' counters, never replaced
    cdef int[::1] inflight

    def __init__(self, writes):
        self.writes = writes
        self.replication = writes.replication
        self.table = writes.table
        self.page_crcs = writes.page_crcs  # the writes' checksum function (see the reference)
        self.counters = writes.counters
        self.inflight = self.table.inflight  # the table's own array, never replaced

    def start_write(self, Py_ssize_t offset, data, done, tag):
        cdef Py_ssize_t n = len(data)
        cdef Py_ssize_t first, count, slab, sp
        cdef ReplicatedWrite w
        assert not (offset | n) & MASK, f"unaligned request ({offset}, {n})"
        if offset < 0:  # the typed view below is not bounds-checked: never index it below 0
            raise ValueError(f"negative offset {offset}")
        if not self.replication.open:
            return False
        t = self.table
        first, count = offset >> PAGE_SHIFT, n >> PAGE_SHIFT
        sp = t.slab_pages
        slab = first // sp
        clients = self._connected_replicas(slab, count)
        if clients is None or (first + count - 1) // sp != slab:
            return False
        w = ReplicatedWrite.__new__(ReplicatedWrite)
        w.owner = self
        w.slab, w.first, w.count = slab, first, count
        w.data, w.done, w.tag = data, done, tag
        w.waiting = w.replicas = len(clients)
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        self.inflight[slab] += 1  # a repair starting now waits for this write to finish
        if w.waiting > 1:  # registered before any STORE can leave
            w.token = t.write_started(first, count, data)
        for c in clients:
            if c.rdma is None:  # by TCP (connected, as just checked): into its send queue
                c.queue.store_cb(keys, data, w)
            elif not c.store_cb(keys, data, w):  # not connected after all: a failure
                w(MemserverUnreachable(f"not connected to memserver {c.peer}"))
        if count > 1:  # the checksums, while the memservers copy the pages (see the reference)
            clients[0].loop.call_soon(w.compute_crcs)
        return True

    cdef object _connected_replicas(self, Py_ssize_t slab, Py_ssize_t count):
        clients = self.table.slab_clients[slab]
        if slab in self.replication.repairs:
            return None
        for c in clients:
            # a client's max_batch is at least 1: a one-page write fits without asking it
            if c.hello is None or (count > 1 and count > c.max_batch):
                return None
        return clients
