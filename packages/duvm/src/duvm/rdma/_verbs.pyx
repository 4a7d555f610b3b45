# cython: language_level=3
"""The verbs calls of duvm's RDMA path (libibverbs, librdmacm), compiled: rdma-cm connections,
protection domains, memory regions, and the daemon's one-sided READ/WRITE queue.

Theory of operation
-------------------
- `EventChannel` wraps an rdma-cm event channel (its fd is non-blocking, for an asyncio
  reader); `get_event()` returns one event as plain Python values, already acknowledged.
- `CmId` is one rdma-cm identifier: a listener (`listen`), a connection request it received
  (`accept`/`reject`) or an active side (`resolve`, then `connect`).
- `Domain` is a protection domain with a completion queue and the connection's RC queue pair;
  `register(addr, length, remote)` returns a `Region` (lkey, rkey). A queue pair can only touch
  regions of its own domain: the memserver gives each client its own domain, so one client's
  rkeys are refused on another's queue pair by the NIC itself.
- `Staging` is the daemon's buffer of page slots for one memserver, mapped, populated and locked
  once, before swap needs it: a reconnect registers the same memory again instead of
  allocating under memory pressure.
- `Queue` is the daemon's side of one queue pair: its `Staging` registered in the queue pair's
  domain, `post(write, keys, data_or_out, cb, map)` copies and posts a chain of work requests
  (one per run of consecutive keys in one chunk), `poll()` completes them (`cb(None)`, or the
  failure's status for `fail_all`).

Nothing here blocks: connection steps are driven by events, completions by the completion
channel's fd. Every pointer is owned by exactly one object and freed in its `close()`.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

from duvm.rdma._libverbs cimport *  # the C declarations (libibverbs, librdmacm, glue)

cdef extern from *:
    const char *DUVM_SOURCE_DIGEST

SOURCE_DIGEST = DUVM_SOURCE_DIGEST.decode()

# event numbers, for the Python side
ADDR_RESOLVED = RDMA_CM_EVENT_ADDR_RESOLVED
ROUTE_RESOLVED = RDMA_CM_EVENT_ROUTE_RESOLVED
CONNECT_REQUEST = RDMA_CM_EVENT_CONNECT_REQUEST
ESTABLISHED = RDMA_CM_EVENT_ESTABLISHED
DISCONNECTED = RDMA_CM_EVENT_DISCONNECTED
REJECTED = RDMA_CM_EVENT_REJECTED
UNREACHABLE = RDMA_CM_EVENT_UNREACHABLE
ADDR_ERROR = RDMA_CM_EVENT_ADDR_ERROR
ROUTE_ERROR = RDMA_CM_EVENT_ROUTE_ERROR
CONNECT_ERROR = RDMA_CM_EVENT_CONNECT_ERROR
DEVICE_REMOVAL = RDMA_CM_EVENT_DEVICE_REMOVAL
TIMEWAIT_EXIT = RDMA_CM_EVENT_TIMEWAIT_EXIT

cdef enum:
    PAGE = 4096
    MAX_CHAIN = 64  # work requests in one chain (the glue's array size)
    POLL_BATCH = 32  # completions per ibv_poll_cq (the glue's array size)


class VerbsError(OSError):
    """A verbs or rdma-cm call failed; `errno` and the call are in the message."""


cdef _fail(str what, int err=0):
    if err == 0:
        err = errno
    raise VerbsError(err, f"{what}: {strerror(err).decode()}")


def event_name(int event):
    return rdma_event_str(event).decode()


def status_name(int status):
    return ibv_wc_status_str(status).decode()


def devices():
    """[(name, [port states...], max_qp_rd_atom)] of the verbs devices here; port state 4 is
    ACTIVE. Raises VerbsError when the device list cannot be read."""
    cdef int n = 0, i, p
    cdef ibv_device **lst = ibv_get_device_list(&n)
    cdef ibv_context *ctx
    cdef ibv_device_attr attr
    cdef ibv_port_attr port
    if lst == NULL:
        _fail("ibv_get_device_list")
    out = []
    try:
        for i in range(n):
            name = ibv_get_device_name(lst[i]).decode()
            ctx = ibv_open_device(lst[i])
            if ctx == NULL:
                out.append((name, None, 0))
                continue
            states = []
            memset(&attr, 0, sizeof(attr))
            if ibv_query_device(ctx, &attr) == 0:
                for p in range(1, 3):
                    memset(&port, 0, sizeof(port))
                    if ibv_query_port(ctx, p, &port) != 0:
                        break
                    states.append(<int>port.state)
            ibv_close_device(ctx)
            out.append((name, states, attr.max_qp_rd_atom))
    finally:
        ibv_free_device_list(lst)
    return out


cdef class EventChannel:
    """An rdma-cm event channel; `fd` is non-blocking (an asyncio reader waits on it)."""

    cdef rdma_event_channel *ch
    cdef dict ids  # address of an rdma_cm_id -> its CmId (events name ids by pointer)

    def __cinit__(self):
        self.ch = rdma_create_event_channel()
        if self.ch == NULL:
            _fail("rdma_create_event_channel")
        flags = fcntl(self.ch.fd, F_GETFL)
        fcntl(self.ch.fd, F_SETFL, flags | O_NONBLOCK)
        self.ids = {}

    @property
    def fd(self):
        return self.ch.fd if self.ch != NULL else -1

    def get_event(self):
        """One event as (event, status, CmId, private data bytes), or None when none is
        waiting. A connection request's CmId is new (its `listener` is the listening one)."""
        cdef rdma_cm_event *ev
        if self.ch == NULL:
            return None
        if rdma_get_cm_event(self.ch, &ev) != 0:
            if errno == 11:  # EAGAIN
                return None
            _fail("rdma_get_cm_event")
        try:
            kind, status = ev.event, ev.status
            data = b""
            if duvm_event_private_len(ev) and duvm_event_private_data(ev) != NULL:
                data = (<const char *>duvm_event_private_data(ev))[:duvm_event_private_len(ev)]
            key = <uintptr_t>ev.id
            cm = self.ids.get(key)
            if cm is None and kind == RDMA_CM_EVENT_CONNECT_REQUEST:
                cm = CmId.__new__(CmId)
                (<CmId>cm).id = ev.id
                (<CmId>cm).channel = self
                (<CmId>cm).listener = self.ids.get(<uintptr_t>ev.listen_id)
                self.ids[key] = cm
            return kind, status, cm, data
        finally:
            rdma_ack_cm_event(ev)

    def close(self):
        if self.ch != NULL and not self.ids:
            rdma_destroy_event_channel(self.ch)
            self.ch = NULL


cdef class CmId:
    """One rdma-cm identifier on an `EventChannel`."""

    cdef rdma_cm_id *id
    cdef readonly EventChannel channel
    cdef readonly object listener
    cdef public object owner  # whatever the Python side keeps with this connection
    cdef Domain domain

    @staticmethod
    def create(EventChannel channel):
        cdef CmId self = CmId.__new__(CmId)
        if rdma_create_id(channel.ch, &self.id, NULL, RDMA_PS_TCP) != 0:
            _fail("rdma_create_id")
        self.channel = channel
        channel.ids[<uintptr_t>self.id] = self
        return self

    cdef rdma_addrinfo *_addr(self, str host, int port, bint passive) except NULL:
        cdef rdma_addrinfo hints
        cdef rdma_addrinfo *res = NULL
        memset(&hints, 0, sizeof(hints))
        if passive:
            hints.ai_flags = RAI_PASSIVE
        hb, pb = host.encode(), str(port).encode()
        rc = rdma_getaddrinfo(hb, pb, &hints, &res)
        if rc != 0 or res == NULL:
            _fail(f"rdma_getaddrinfo({host}:{port})", errno or 22)
        return res

    def listen(self, str host, int port, int backlog=64):
        cdef rdma_addrinfo *res = self._addr(host, port, True)
        try:
            if rdma_bind_addr(self.id, res.ai_src_addr) != 0:
                _fail(f"rdma_bind_addr({host}:{port})")
        finally:
            rdma_freeaddrinfo(res)
        if rdma_listen(self.id, backlog) != 0:
            _fail("rdma_listen")

    def resolve_addr(self, str host, int port, int timeout_ms=2000):
        cdef rdma_addrinfo *res = self._addr(host, port, False)
        try:
            if rdma_resolve_addr(self.id, NULL, res.ai_dst_addr, timeout_ms) != 0:
                _fail(f"rdma_resolve_addr({host}:{port})")
        finally:
            rdma_freeaddrinfo(res)

    def resolve_route(self, int timeout_ms=2000):
        if rdma_resolve_route(self.id, timeout_ms) != 0:
            _fail("rdma_resolve_route")

    @property
    def device(self):
        """The verbs device this id is bound to (None before the address is resolved)."""
        if self.id == NULL or self.id.verbs == NULL:
            return None
        return ibv_get_device_name(self.id.verbs.device).decode()

    def max_read_depth(self):
        """RDMA READs the device lets one queue pair have in flight (at most 16)."""
        cdef ibv_device_attr attr
        if self.id.verbs == NULL or ibv_query_device(self.id.verbs, &attr) != 0:
            return 1
        return max(1, min(16, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom))

    def create_domain(self, int depth, bint events):
        """A protection domain, completion queue and RC queue pair for this connection
        (`depth` work requests each way; a completion channel when `events`)."""
        self.domain = Domain._create(self, depth, events)
        return self.domain

    def connect(self, bytes private_data, int read_depth):
        cdef rdma_conn_param p
        duvm_conn_param(&p, <const char *>private_data, len(private_data), read_depth)
        if rdma_connect(self.id, &p) != 0:
            _fail("rdma_connect")

    def accept(self, int read_depth):
        cdef rdma_conn_param p
        duvm_conn_param(&p, NULL, 0, read_depth)
        if rdma_accept(self.id, &p) != 0:
            _fail("rdma_accept")

    def reject(self):
        if self.id != NULL:
            rdma_reject(self.id, NULL, 0)

    def disconnect(self):
        if self.id != NULL:
            rdma_disconnect(self.id)

    def close(self):
        """Destroy the queue pair, the domain's regions and the id itself."""
        if self.id == NULL:
            return
        if self.domain is not None:
            self.domain._close(self)
            self.domain = None
        self.channel.ids.pop(<uintptr_t>self.id, None)
        rdma_destroy_id(self.id)
        self.id = NULL


cdef class Region:
    """A registered memory region of a `Domain`."""

    cdef ibv_mr *mr
    cdef readonly uint64_t addr
    cdef readonly uint64_t length

    @property
    def lkey(self):
        return self.mr.lkey if self.mr != NULL else 0

    @property
    def rkey(self):
        return self.mr.rkey if self.mr != NULL else 0

    @property
    def registered(self):
        return self.mr != NULL

    def close(self):
        """Deregister: from now on the NIC refuses this region's keys."""
        if self.mr != NULL:
            ibv_dereg_mr(self.mr)
            self.mr = NULL


cdef class Domain:
    """A protection domain with one completion queue and one RC queue pair (on its CmId)."""

    cdef ibv_pd *pd
    cdef ibv_comp_channel *cc
    cdef ibv_cq *cq
    cdef list regions
    cdef readonly int depth

    @staticmethod
    cdef Domain _create(CmId cm, int depth, bint events):
        cdef Domain self = Domain.__new__(Domain)
        cdef ibv_qp_init_attr attr
        self.regions = []
        self.depth = depth
        if cm.id.verbs == NULL:
            raise VerbsError(22, "no device: resolve the address first")
        self.pd = ibv_alloc_pd(cm.id.verbs)
        if self.pd == NULL:
            _fail("ibv_alloc_pd")
        if events:
            self.cc = ibv_create_comp_channel(cm.id.verbs)
            if self.cc == NULL:
                self._free()
                _fail("ibv_create_comp_channel")
            flags = fcntl(self.cc.fd, F_GETFL)
            fcntl(self.cc.fd, F_SETFL, flags | O_NONBLOCK)
        self.cq = ibv_create_cq(cm.id.verbs, depth + 1, NULL, self.cc, 0)
        if self.cq == NULL:
            self._free()
            _fail("ibv_create_cq")
        memset(&attr, 0, sizeof(attr))
        attr.send_cq = self.cq
        attr.recv_cq = self.cq
        attr.cap.max_send_wr = depth
        attr.cap.max_recv_wr = 1
        attr.cap.max_send_sge = 1
        attr.cap.max_recv_sge = 1
        attr.qp_type = IBV_QPT_RC
        if rdma_create_qp(cm.id, self.pd, &attr) != 0:
            err = errno
            self._free()
            _fail("rdma_create_qp", err)
        if events and duvm_req_notify(self.cq) != 0:
            err = errno
            rdma_destroy_qp(cm.id)
            self._free()
            _fail("ibv_req_notify_cq", err)
        return self

    @property
    def fd(self):
        """The completion channel's fd (-1 without one)."""
        return self.cc.fd if self.cc != NULL else -1

    def register(self, uint64_t addr, uint64_t length, bint remote):
        """Register `length` bytes at `addr` (memory the caller keeps mapped until the
        region is closed): local access, plus remote READ and WRITE when `remote`."""
        cdef Region r = Region.__new__(Region)
        cdef int access = IBV_ACCESS_LOCAL_WRITE
        if remote:
            access |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE
        r.mr = ibv_reg_mr(self.pd, <void *><uintptr_t>addr, length, access)
        if r.mr == NULL:
            _fail(f"ibv_reg_mr of {length} bytes")
        r.addr, r.length = addr, length
        self.regions.append(r)
        return r

    cdef void _free(self):
        for r in self.regions:
            (<Region>r).close()
        self.regions = []
        if self.cq != NULL:
            ibv_destroy_cq(self.cq)
            self.cq = NULL
        if self.cc != NULL:
            ibv_destroy_comp_channel(self.cc)
            self.cc = NULL
        if self.pd != NULL:
            ibv_dealloc_pd(self.pd)
            self.pd = NULL

    cdef void _close(self, CmId cm):
        if cm.id.qp != NULL:
            rdma_destroy_qp(cm.id)
        self._free()


cdef class _Request:
    cdef object cb
    cdef object out  # a LOAD's destination (a writable buffer), None for a STORE
    cdef int first_slot
    cdef int npages


cdef class Staging:
    """`slots` pages of memory for RDMA transfers: mapped, populated and locked (when the
    process may) once, and kept across connections (each registers it in its own domain).
    With `fd`, the file's pages mapped shared: the daemon's and its standby's (D48)."""

    cdef char *buf
    cdef readonly size_t nbytes
    cdef readonly int slots
    cdef readonly bint locked
    cdef readonly bint shared

    def __cinit__(self, int slots, int fd=-1):
        self.slots = slots
        self.nbytes = <size_t>slots * PAGE
        self.shared = fd >= 0
        flags = (MAP_SHARED if self.shared else MAP_PRIVATE | MAP_ANONYMOUS) | MAP_POPULATE
        self.buf = <char *>mmap(NULL, self.nbytes, PROT_READ | PROT_WRITE, flags, fd, 0)
        if <void *>self.buf == MAP_FAILED:
            self.buf = NULL
            _fail("mmap of the staging buffer")
        self.locked = mlock(self.buf, self.nbytes) == 0

    def __dealloc__(self):
        if self.buf != NULL:
            munmap(self.buf, self.nbytes)


cdef class Queue:
    """The daemon's one-sided requests on one connected queue pair.

    Its `Staging`, registered for local access in the queue pair's domain, carries every
    request's bytes: a STORE is copied in and RDMA-written out, a LOAD is RDMA-read in and
    copied out at completion. Remote addresses come from `chunks` (chunk index -> (remote
    address, rkey)), each chunk `chunk_pages` consecutive keys.
    """

    cdef CmId cm
    cdef Domain dom
    cdef Staging mem  # kept alive as long as the queue (the NIC may use it until then)
    cdef Region staging
    cdef char *buf
    cdef size_t nbytes
    cdef int nslots
    cdef unsigned char *used  # per staging slot: taken (runs are taken first fit)
    cdef dict pending  # wr_id -> _Request
    cdef uint64_t next_id
    cdef readonly int chunk_pages
    cdef readonly int in_flight
    cdef readonly uint64_t posted
    cdef readonly uint64_t completed
    cdef public object missing  # the chunk `post` found unmapped

    def __cinit__(self, CmId cm, Staging mem, int chunk_pages):
        self.cm = cm
        self.dom = cm.domain
        self.mem = mem
        self.chunk_pages = chunk_pages
        self.nslots = mem.slots
        self.nbytes = mem.nbytes
        self.buf = mem.buf
        self.used = <unsigned char *>malloc(self.nslots)
        if self.used == NULL:
            raise MemoryError()
        memset(self.used, 0, self.nslots)
        self.pending = {}
        self.next_id = 1
        self.staging = self.dom.register(<uintptr_t>self.buf, self.nbytes, False)

    def __dealloc__(self):
        if self.used != NULL:
            free(self.used)

    @property
    def fd(self):
        return self.dom.fd

    cdef int _take(self, int n):
        """First slot of `n` free consecutive staging slots, or -1."""
        cdef int i = 0, run = 0
        while i < self.nslots:
            if self.used[i]:
                run = 0
            else:
                run += 1
                if run == n:
                    memset(self.used + i - n + 1, 1, n)
                    return i - n + 1
            i += 1
        return -1

    cdef void _give(self, int first, int n):
        memset(self.used + first, 0, n)

    def post(self, bint write, tuple keys, object data, object cb, dict chunks):
        """Post one STORE (`write`, `data` the pages) or LOAD (`data` the writable
        destination) of `keys`. Returns 1 when posted, 0 when a chunk is not mapped yet
        (its index is then in `self.missing`), -1 when the staging buffer is full; nothing
        is posted unless 1 is returned."""
        cdef Py_buffer view
        cdef int n = len(keys), i, runs = 0, first, rc
        cdef uint64_t laddr[MAX_CHAIN]
        cdef uint64_t raddr[MAX_CHAIN]
        cdef uint32_t lens[MAX_CHAIN]
        cdef uint32_t rkey = 0, this_rkey
        cdef long long key, prev = -2, chunk
        cdef long long cp = self.chunk_pages
        cdef uint64_t base
        cdef _Request req
        if n == 0:
            raise ValueError("no keys")
        # remote addresses of each run of consecutive keys inside one chunk
        for i in range(n):
            key = keys[i]
            chunk = key // cp
            entry = chunks.get(chunk)
            if entry is None:
                self.missing = chunk
                return 0
            base = entry[0]
            this_rkey = entry[1]
            if runs and key == prev + 1 and (key % cp) != 0 and this_rkey == rkey:
                lens[runs - 1] += PAGE
            else:
                if runs and this_rkey != rkey:
                    raise ValueError("one request's chunks have different rkeys")
                if runs == MAX_CHAIN:
                    raise ValueError(f"more than {MAX_CHAIN} runs in one request")
                rkey = this_rkey
                raddr[runs] = base + <uint64_t>(key - chunk * cp) * PAGE
                lens[runs] = PAGE
                runs += 1
            prev = key
        first = self._take(n)
        if first < 0:
            return -1
        laddr[0] = <uintptr_t>(self.buf + <size_t>first * PAGE)
        for i in range(1, runs):
            laddr[i] = laddr[i - 1] + lens[i - 1]
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE if write else PyBUF_WRITABLE)
        try:
            if view.len != <Py_ssize_t>n * PAGE:
                self._give(first, n)
                raise ValueError(f"{n} pages need {n * PAGE} bytes, got {view.len}")
            if write:
                memcpy(self.buf + <size_t>first * PAGE, view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
        req = _Request.__new__(_Request)
        req.cb = cb
        req.out = None if write else data
        req.first_slot = first
        req.npages = n
        wr_id = self.next_id
        self.next_id += 1
        rc = duvm_post_chain(self.cm.id.qp, wr_id, write, runs, laddr, lens,
                             self.staging.mr.lkey, raddr, rkey)
        if rc != 0:
            self._give(first, n)
            _fail("ibv_post_send", rc)
        self.pending[wr_id] = req
        self.in_flight += 1
        self.posted += 1
        return 1

    def poll(self):
        """Acknowledge the completion event, re-arm, and complete every finished request.
        Returns None, or the first failed completion's status name: the queue pair is then in
        error, and the failed requests stay pending for `fail_all` with the rest."""
        cdef ibv_cq *ev_cq
        cdef void *ev_ctx
        cdef uint64_t ids[POLL_BATCH]
        cdef int st[POLL_BATCH]
        cdef int op[POLL_BATCH]
        cdef int n, i
        cdef Py_buffer view
        cdef _Request req
        failed = None
        if self.dom.cc != NULL:
            while ibv_get_cq_event(self.dom.cc, &ev_cq, &ev_ctx) == 0:
                ibv_ack_cq_events(ev_cq, 1)
            duvm_req_notify(self.dom.cq)
        while True:
            n = duvm_poll(self.dom.cq, POLL_BATCH, ids, st, op)
            if n <= 0:
                break
            for i in range(n):
                if st[i] != IBV_WC_SUCCESS:
                    # the queue pair is in error now: the request stays pending for
                    # `fail_all`, with the rest, once the caller has dropped the connection
                    if failed is None:
                        failed = status_name(st[i])
                    continue
                req = self.pending.pop(ids[i], None)
                if req is None:
                    continue
                self.in_flight -= 1
                self.completed += 1
                if req.out is not None:
                    PyObject_GetBuffer(req.out, &view, PyBUF_WRITABLE)
                    memcpy(view.buf, self.buf + <size_t>req.first_slot * PAGE,
                           <size_t>req.npages * PAGE)
                    PyBuffer_Release(&view)
                self._give(req.first_slot, req.npages)
                req.cb(None)
        return failed

    def fail_all(self, exc):
        """Fail every request still in flight with `exc` (a dropped connection). Their
        staging slots stay taken: the NIC may still be using them until the queue pair is
        destroyed, after which the whole buffer goes."""
        pending, self.pending = self.pending, {}
        self.in_flight = 0
        for req in pending.values():
            (<_Request>req).cb(exc)
