"""`RemoteStore`: a BlockStore whose pages live in memservers' RAM, replicated and checked.

Usage (the NBD daemon does exactly this)::

    store = await RemoteStore.open([("10.0.0.2", 7070), ("10.0.0.3", 7070)],
                                   size=4 << 30, client_id="node1:/dev/nbd0:1732900000",
                                   replicas=2)
    await store.write(0, memoryview(page))      # BlockStore interface, page-aligned
    store.health()                              # degraded slabs, repairs, failovers (JSON-ready)
    await store.close()                         # RELEASEs the pages on every memserver

Theory of operation:

- The export is cut into slabs of `slab_pages` pages. Before the export is offered, every slab
  is placed on `replicas` distinct memservers (`placement.place`: power of two choices on free
  room, never two replicas on one memserver) and each memserver RESERVEs the pages of its
  slabs. Reserve before exposing: a write the kernel sends always has somewhere to go.
- Page p of the export is key p in this client's namespace on each memserver of its slab.
- Per page the store keeps a state byte (0 never written or trimmed: reads are zeros made here
  with no network trip; 1 holds data; 2 lost: reads fail with EIO until it is written again) and
  the CRC-32C of the bytes last acknowledged (the `crc32c` package, SSE4.2 where the CPU has it:
  about 2.7k instructions per 4 KiB page against 17k for `zlib.crc32` and far more for
  BLAKE2b; it detects corruption, it is no defence against a malicious memserver, which
  encryption with authentication covers).
- Writes go to every live replica of the slab at once and are acknowledged only when all of
  them stored the pages. A replica that fails (unreachable, stalled, refused) is dropped from the
  slab, which is then degraded, and the write is acknowledged by the survivors. If no replica
  stored it, the write fails: with ENOSPC when every replica refused for space (the old bytes
  remain everywhere), else with EIO, and the pages are marked lost, because replicas may now
  disagree and a read must never return bytes other than the last written.
- Reads LOAD from the first replica that answers and verify every page's checksum. A replica
  that is unreachable is skipped (a failover); one that answers NOT_FOUND or bad bytes is
  dropped from the slab. If no replica has good bytes, the pages are lost (EIO from now on);
  if replicas were merely unreachable, the read waits (`unreachable_wait`, 30 s) for one to
  come back, then fails with EIO; a later read may still succeed. Writes that reach no
  replica wait the same way; only then are their pages marked lost.
- When a memserver comes back without our namespace (it restarted), `_namespace_lost` drops
  it from every slab that has another replica; slabs where it was the only one keep it (the
  reservation is restored) and their written pages are marked lost.
- Repair (`repair.Repairer`, a background task) restores R for degraded slabs; while a slab is
  being copied, writes and trims to it also go to the new replica, under a per-slab lock that
  the copier holds for each chunk, so a copied page can never overwrite a newer write.
- A watchdog aborts connections whose requests made no progress for `op_timeout` seconds
  (a cut link or a frozen memserver), so a write is not held hostage by one replica: the
  aborted replica is dropped and the survivors acknowledge.
- Requests arrive validated: the NBD layer advertises a 4096-byte minimum block and refuses
  anything unaligned or past the end with EINVAL (`nbdproto.validate`); here alignment is only
  asserted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from array import array
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from crc32c import crc32c as _crc32

from duvm.base.quietlog import QuietLog
from duvm.store.memclient import MemClient, MemserverUnreachable, PageServerError
from duvm.store.placement import normalize_peers, place
from duvm.store.readahead import Readahead
from duvm.store.repair import Repairer, SlabRepair
from duvm.store.storage import (
    DATA,
    EMPTY,
    LOST,
    PAGE_SIZE,
    Batching,
    BlockStore,
    Capabilities,
    Done,
    StorageError,
)
from duvm.wire.auth import PeerSecurity
from duvm.wire.pageproto import MAX_BATCH, ErrorCode

log = logging.getLogger(__name__)

DEFAULT_SLAB_PAGES = 256  # 1 MiB slabs: fine-grained placement, big enough for batched I/O
DEFAULT_SUMMARY_EVERY = 30.0  # seconds between failover summaries in the log
DEFAULT_OP_TIMEOUT = 5.0  # seconds without progress before a memserver connection is dropped
# When no replica of a slab can be reached, requests wait this long for one to come back
# (a restart, a flapping link) before failing: for swap, a stall beats an I/O error.
DEFAULT_UNREACHABLE_WAIT = 30.0
RETRY_MIN_S, RETRY_MAX_S = 0.05, 1.0
_MASK = PAGE_SIZE - 1
_ZEROS = bytes(256 * PAGE_SIZE)
_ZERO_PAGE = _ZEROS[:PAGE_SIZE]
_FAILURES = (PageServerError, MemserverUnreachable)
assert PAGE_SIZE == 1 << 12  # the hot paths shift by 12


def page_crcs(buf: memoryview, count: int) -> array:
    """The CRC-32C of each of the first `count` pages of `buf`. The per-page loop runs in C
    (map over precomputed slices): a batch of 64 pages costs no Python bytecode per page."""
    slices = (
        _PAGE_SLICES[:count]
        if count <= len(_PAGE_SLICES)
        else [slice(k << 12, (k + 1) << 12) for k in range(count)]
    )
    return array("I", map(_crc32, map(buf.__getitem__, slices)))


_PAGE_SLICES = tuple(slice(k << 12, (k + 1) << 12) for k in range(MAX_BATCH))


def _storage_error(e: Exception, what: str) -> StorageError:
    if isinstance(e, PageServerError) and e.code == ErrorCode.NO_SPACE:
        return StorageError(errno.ENOSPC, f"{what}: {e}")
    return StorageError(errno.EIO, f"{what}: {e}")


class _UnreachableWait:
    """Backoff while no replica answers: for swap a stall beats an error, up to a limit."""

    def __init__(self, store: RemoteStore) -> None:
        self._store = store
        self._deadline: float | None = None
        self._delay = RETRY_MIN_S

    async def again(self) -> bool:
        """Sleep and return True while `unreachable_wait` has not passed; else False."""
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self._store.unreachable_wait
        if now >= self._deadline:
            return False
        self._store.stats["unreachable_waits"] += 1
        await asyncio.sleep(self._delay)
        self._delay = min(2 * self._delay, RETRY_MAX_S)
        return True


class RemoteStore(BlockStore):
    """`size` bytes (a multiple of 4096) on the memservers `peers`, in namespace `client_id`."""

    capabilities = Capabilities()
    fast_path = True  # start_read/start_write (the callback path below)

    def __init__(
        self,
        peers: list[tuple[str, int]],
        size: int,
        client_id: str,
        *,
        slab_pages: int = DEFAULT_SLAB_PAGES,
        replicas: int = 1,
        connect_timeout: float = 5.0,
        op_timeout: float = DEFAULT_OP_TIMEOUT,
        unreachable_wait: float = DEFAULT_UNREACHABLE_WAIT,
        repair: bool = True,
        seed: int | None = None,
        tables: tuple[Any, Any] | None = None,
        security: PeerSecurity | None = None,
    ) -> None:
        if size <= 0 or size & _MASK:
            raise ValueError(f"size must be a positive multiple of {PAGE_SIZE}, not {size}")
        if not peers:
            raise ValueError("at least one memserver is needed")
        peers = normalize_peers(peers)
        if slab_pages < 1:
            raise ValueError("slab_pages must be positive")
        if not 1 <= replicas <= len(peers):
            raise ValueError(f"replicas must be 1..{len(peers)} (the number of peers)")
        self.size = size
        self.pages = size // PAGE_SIZE
        self.client_id = client_id
        self.slab_pages = slab_pages
        self.replicas = replicas
        self.op_timeout = op_timeout
        self.unreachable_wait = unreachable_wait
        self.batching = Batching()  # shared by its connections and the NBD server
        self.clients = [
            MemClient(
                h,
                p,
                client_id,
                connect_timeout=connect_timeout,
                security=security,
                batching=self.batching,
            )
            for h, p in peers
        ]
        for c in self.clients:
            c.on_namespace_lost = self._namespace_lost
        self._index = {c: i for i, c in enumerate(self.clients)}
        self.nslabs = -(-self.pages // slab_pages)
        self.rng = random.Random(seed)
        self.sets: list[list[int]] = []  # slab -> live replica peer indices, preferred first
        self._slab_clients: list[tuple[MemClient, ...]] = []  # the same, as clients
        self.repairs: dict[int, SlabRepair] = {}  # slab -> copy in progress
        self.reserved = [0] * len(self.clients)  # pages we reserved on each peer
        self.assigned = [0] * len(self.clients)  # pages of slabs placed (or copying) there
        # (peer, slab): a dropped copy that may still hold pages there (counted in assigned)
        self.stale: set[tuple[int, int]] = set()
        self._state = bytearray(self.pages)  # EMPTY / DATA / LOST per page
        self._crc = array("I", bytes(4 * self.pages))
        if tables is not None:  # persisted tables (daemon_state.PageTables: mmap on tmpfs)
            if len(tables[0]) != self.pages or len(tables[1]) != self.pages:
                raise ValueError(f"page tables must have {self.pages} entries")
            self._state, self._crc = tables
        # called after any change of a slab's replica set (the daemon persists the map)
        self.on_placement_change: Callable[[], None] | None = None
        self.inflight = array("i", bytes(4 * self.nslabs))  # unlocked writes/trims per slab
        self._open = False
        self._tasks: list[asyncio.Task] = []
        self._probes: set[asyncio.Task] = set()  # background reconnect attempts
        self._want_repair = repair
        self.repairer = None
        self.stats = {
            "loads": 0,
            "stores": 0,
            "frees": 0,
            "zero_reads": 0,
            "pages_loaded": 0,
            "pages_stored": 0,
            "pages_freed": 0,
            "failovers": 0,
            "replicas_dropped": 0,
            "checksum_failures": 0,
            "pages_lost": 0,
            "read_errors": 0,
            "write_errors": 0,
            "stalls_aborted": 0,
            "unreachable_waits": 0,
            "ra_loads": 0,
            "ra_hits": 0,
            "ra_dropped": 0,
        }
        self.readahead = Readahead(self)
        self.events = QuietLog(log)  # failover messages: one line per kind, then counts
        self.summary_every = DEFAULT_SUMMARY_EVERY
        self._was_degraded = False
        # replicated writes in flight, (first page, pages, bytes): a racing read may see them
        self._pending_writes: list[tuple[int, int, memoryview]] = []

    @classmethod
    async def open(
        cls, peers: list[tuple[str, int]], size: int, client_id: str, **kwargs: object
    ) -> RemoteStore:
        """Build, connect and reserve; see `connect`."""
        store = cls(peers, size, client_id, **kwargs)  # type: ignore[arg-type]
        await store.connect()
        return store

    @property
    def placement(self) -> list[tuple[int, ...]]:
        """Each slab's live replica set (peer indices)."""
        return [tuple(s) for s in self.sets]

    def slab_size(self, slab: int) -> int:
        return min(self.slab_pages, self.pages - slab * self.slab_pages)

    # --- setup ---

    async def connect(self) -> None:
        """Connect to every peer, place the slabs and reserve them. All or nothing."""
        results = await asyncio.gather(*(c.connect() for c in self.clients), return_exceptions=True)
        failed = [
            f"{c.peer} ({r})"
            for c, r in zip(self.clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        try:
            if failed:
                raise StorageError(
                    errno.EHOSTUNREACH, "memserver unreachable: " + "; ".join(failed)
                )
            # A namespace resumed by a new store holds pages nobody can name any more.
            stale = [c for c in self.clients if c.hello.stored_pages or c.hello.reserved_pages]
            if stale:
                await asyncio.gather(*(c.release() for c in stale))
            statuses = await asyncio.gather(*(c.status() for c in self.clients))
            room = [s["unreserved_pages"] for s in statuses]
            sizes = [self.slab_size(s) for s in range(self.nslabs)]
            placement = place(sizes, room, self.replicas, self.rng)
            want = [0] * len(self.clients)
            for slab, peers in enumerate(placement):
                for i in peers:
                    want[i] += sizes[slab]
            res = await asyncio.gather(
                *(c.reserve(n) for c, n in zip(self.clients, want, strict=True) if n),
                return_exceptions=True,
            )
            errs = [r for r in res if isinstance(r, BaseException)]
            if errs:
                raise _storage_error(errs[0], "reserving capacity failed")
        except BaseException:
            await self._abandon()
            raise
        self._begin(placement, want)

    async def reattach(self, placement: list[list[int]]) -> None:
        """Take over the namespaces a crashed predecessor left (same client id and token, and
        this store built on its persisted page tables) with its slab map `placement`. Nothing
        is released: the memservers keep the pages for their lease. A memserver that lost the
        namespace meanwhile is handled as on a reconnect (`_namespace_lost`)."""
        if len(placement) != self.nslabs or any(
            not p or len(set(p)) != len(p) or not all(0 <= i < len(self.clients) for i in p)
            for p in placement
        ):
            raise ValueError(
                f"placement must name 1+ distinct peers for each of {self.nslabs} slabs"
            )
        results = await asyncio.gather(*(c.connect() for c in self.clients), return_exceptions=True)
        failed = [
            f"{c.peer} ({r})"
            for c, r in zip(self.clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            for c in self.clients:
                await c.close()  # never RELEASE here: the pages belong to a live device
            raise StorageError(errno.EHOSTUNREACH, "memserver unreachable: " + "; ".join(failed))
        want = [0] * len(self.clients)
        for slab, peers in enumerate(placement):
            for i in peers:
                want[i] += self.slab_size(slab)
        self._begin(placement, want)
        for c in self.clients:
            if not c.hello.resumed:
                self._namespace_lost(c)
        res = await asyncio.gather(
            *(c.reserve(n) for c, n in zip(self.clients, want, strict=True) if n),
            return_exceptions=True,
        )
        for r in res:
            if isinstance(r, BaseException):
                log.error("reserving on resume failed: %s", r)

    def _begin(self, placement: list[list[int]], want: list[int]) -> None:
        self.reserved = list(want)
        self.assigned = list(want)
        self.sets = [list(p) for p in placement]
        self._slab_clients = [tuple(self.clients[i] for i in s) for s in self.sets]
        self._open = True
        self._tasks.append(asyncio.ensure_future(self._watchdog()))
        if self._want_repair:
            self.repairer = Repairer(self)
            self._tasks.append(asyncio.ensure_future(self.repairer.run()))
        log.info(
            "export of %d pages reserved as %d slabs on %d memservers (R=%d)",
            self.pages,
            self.nslabs,
            len(self.clients),
            self.replicas,
        )

    async def _abandon(self) -> None:
        for c in self.clients:
            if c.connected:
                try:
                    await c.release()
                except _FAILURES as e:
                    log.warning("could not release on %s: %s", c.peer, e)
            await c.close()

    async def release(self) -> None:
        """Free every page and reservation on the memservers (the data is gone afterwards)."""
        if not self._open:
            return
        self._open = False
        tasks = [*self._tasks, *self._probes]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._state = bytearray(self.pages)
        self.readahead.clear()
        await self._abandon()

    async def close(self) -> None:
        """Release the pages on every memserver and close the connections."""
        await self.release()

    async def peer_status(self) -> list[dict | None]:
        """Each memserver's STATUS (None for a peer that cannot answer)."""
        res = await asyncio.gather(*(c.status() for c in self.clients), return_exceptions=True)
        return [None if isinstance(r, BaseException) else r for r in res]

    async def _watchdog(self) -> None:
        """Abort connections whose requests made no progress for op_timeout seconds; probe
        peers whose connection dropped, and treat a peer that cannot be reconnected (its
        breaker open) as failed: its slabs become degraded now, so repair starts even if no
        write happens to notice it."""
        period = max(0.05, self.op_timeout / 4)
        probes = self._probes
        next_summary = time.monotonic() + self.summary_every
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if now >= next_summary:
                next_summary = now + self.summary_every
                self.log_summary()
            for i, c in enumerate(self.clients):
                stalled = c.stalled_for(now)
                if stalled > self.op_timeout:
                    self.stats["stalls_aborted"] += 1
                    c.abort(f"no reply for {stalled:.1f} s")
                if c.connected:
                    continue
                if c.circuit_open:
                    for slab, members in enumerate(self.sets):
                        if i in members:
                            self.drop_replica(slab, i, "its memserver is unreachable")
                elif not probes:  # one reconnect attempt at a time, off the I/O path
                    t = asyncio.ensure_future(c.probe())
                    probes.add(t)
                    t.add_done_callback(probes.discard)

    def log_summary(self) -> None:
        """The counted repeats since the last summary, and one line while degraded or lost."""
        self.events.flush()
        degraded = len(self.degraded_slabs())
        lost = self._state.count(LOST)
        if degraded or lost:
            self._was_degraded = True
            log.warning(
                "degraded: %d of %d slabs below %d replicas, %d repairing, %d pages "
                "lost (reads of them fail with EIO)",
                degraded,
                self.nslabs,
                self.replicas,
                len(self.repairs),
                lost,
            )
        elif self._was_degraded:
            self._was_degraded = False
            log.warning("every slab has %d replicas again", self.replicas)

    # --- replica bookkeeping ---

    def _set_replicas(self, slab: int, members: list[int]) -> None:
        self.sets[slab] = members
        self._slab_clients[slab] = tuple(self.clients[i] for i in members)
        if self.on_placement_change is not None:
            self.on_placement_change()

    def drop_replica(self, slab: int, peer: int, why: str) -> bool:
        """Remove `peer` from the slab's replicas unless it is the last one. True if removed."""
        members = self.sets[slab]
        if peer not in members or len(members) == 1:
            return False
        self._set_replicas(slab, [i for i in members if i != peer])
        # Its copy still fills our reservation there until it is freed (the repairer does
        # that), so the room stays counted as assigned: a repair that took it for spare room
        # would be refused (NO_SPACE) by a memserver still holding the dropped pages.
        self.stale.add((peer, slab))
        self.stats["replicas_dropped"] += 1
        # one line per memserver; repeats are counted (a lost memserver drops a copy of every
        # slab it held, each with its own wording of the failure) and summed up by the
        # watchdog's flush
        self.events.event(
            ("dropped", peer),
            logging.WARNING,
            "dropping copies on %s (%s): slab %d now has %d of %d replicas",
            self.clients[peer].peer,
            why,
            slab,
            len(members) - 1,
            self.replicas,
        )
        if self.repairer is not None:
            self.repairer.wake()
        return True

    def add_replica(self, slab: int, peer: int) -> None:
        self._set_replicas(slab, [*self.sets[slab], peer])

    def replace_lost_slab(self, slab: int, target: int) -> None:
        """Every replica of the slab is gone for good: its written pages are lost (reads fail
        with EIO until rewritten) and `target` (already counted in `assigned`) holds it from
        now on, so writes to it succeed again."""
        first, n = slab * self.slab_pages, self.slab_size(slab)
        self._mark_lost(first, n)
        for i in self.sets[slab]:
            self.assigned[i] -= n
        gone = ", ".join(c.peer for c in self._slab_clients[slab])
        self.events.event(
            ("lost", gone),
            logging.ERROR,
            "slab %d: every replica is gone (%s); its written pages are lost "
            "(reads fail with EIO), new writes go to %s",
            slab,
            gone,
            self.clients[target].peer,
        )
        self._set_replicas(slab, [target])

    def _mark_lost(self, first: int, count: int) -> None:
        self.readahead.invalidate(first, count)
        st = self._state
        for p in range(first, first + count):
            if st[p] == DATA:
                st[p] = LOST
                self.stats["pages_lost"] += 1

    def _namespace_lost(self, client: MemClient) -> None:
        """A memserver came back without our namespace: its copies are gone."""
        peer = self._index[client]
        for slab, members in enumerate(self.sets):
            if peer not in members:
                continue
            if not self.drop_replica(slab, peer, "its memserver lost our pages"):
                first = slab * self.slab_pages
                self._mark_lost(first, self.slab_size(slab))
        for p, slab in [x for x in self.stale if x[0] == peer]:  # those pages are gone too
            self.stale.discard((p, slab))
            self.assigned[p] -= self.slab_size(slab)
        for rep in self.repairs.values():
            if rep.target == peer:
                rep.aborted = "the new replica's memserver lost our pages"

    def degraded_slabs(self) -> list[int]:
        """Slabs with fewer live replicas than wanted."""
        return [s for s, m in enumerate(self.sets) if len(m) < self.replicas]

    def pages_per_peer(self) -> list[int]:
        """Written pages held by each peer (a page counts once per replica)."""
        out = [0] * len(self.clients)
        sp, st = self.slab_pages, self._state
        for s, members in enumerate(self.sets):
            n = st.count(DATA, s * sp, (s + 1) * sp)
            if n:
                for i in members:
                    out[i] += n
        return out

    def health(self) -> dict:
        """Replication state for `duvm status` and metrics (JSON-ready), with each peer's
        written pages."""
        degraded = self.degraded_slabs()
        per_peer = [0] * len(self.clients)
        for m in self.sets:
            for i in m:
                per_peer[i] += 1
        pages = self.pages_per_peer()
        rep = self.repairer
        return {
            "replicas": self.replicas,
            "slabs": self.nslabs,
            "slab_pages": self.slab_pages,
            "degraded_slabs": len(degraded),
            "degraded": degraded[:32],
            "repairing": [
                {
                    "slab": s,
                    "target": self.clients[r.target].peer,
                    "copied_pages": r.copied,
                    "total_pages": r.total,
                }
                for s, r in self.repairs.items()
            ],
            "repair": rep.stats if rep is not None else None,
            "pages_written": self._state.count(DATA),
            "pages_lost_now": self._state.count(LOST),
            **self.stats,
            "peers": [
                {
                    "peer": c.peer,
                    "connected": c.connected,
                    "circuit_open": c.circuit_open,
                    "consecutive_failures": c.failures,
                    "breaker_trips": c.breaker_trips,
                    "namespace_losses": c.namespace_losses,
                    "slabs": per_peer[i],
                    "reserved_pages": self.reserved[i],
                    "pages": pages[i],
                }
                for i, c in enumerate(self.clients)
            ],
        }

    # --- block I/O ---

    def _check(self, offset: int, length: int) -> None:
        """Raise for a request the hot paths' quick test flagged. Bounds and alignment are the
        NBD layer's to validate (`nbdproto.validate`, EINVAL to the client); here a request
        that is not page-aligned is a caller's bug, so only asserted."""
        assert not (offset | length) & _MASK, f"unaligned request ({offset}, {length})"
        if not self._open:
            raise StorageError(errno.EIO, "store is not open")

    def _runs(self, first: int, count: int) -> Iterator[tuple[int, int, int]]:
        """Split pages [first, first+count) at slab boundaries: (slab, first, count)."""
        sp, end = self.slab_pages, first + count
        while first < end:
            slab = first // sp
            stop = min(end, (slab + 1) * sp)
            yield slab, first, stop - first
            first = stop

    @staticmethod
    async def _all(coros: list) -> None:
        """Await every part, then raise the first failure (no part outlives the request)."""
        if len(coros) == 1:
            await coros[0]
            return
        for r in await asyncio.gather(*coros, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r

    def describe(self) -> str:
        return f"{len(self.clients)} memserver(s)"

    def memserver_clients(self) -> list[MemClient]:
        return list(self.clients)

    # --- the callback fast path (see storage.BlockStore.start_read) ---

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        """The common read (written pages of one slab, preferred replica connected): one LOAD
        whose reply is checked and answered from the receive path, with no coroutine. Anything
        else, or any failure, continues in `load_verified` (failover, judging replicas)."""
        n = len(out)
        assert not (offset | n) & _MASK, f"unaligned request ({offset}, {n})"
        if not self._open:
            return False
        first, count, st = offset >> 12, n >> 12, self._state
        slab = first // self.slab_pages
        if count == 1:
            if st[first] != DATA:
                return False
        elif (first + count - 1) // self.slab_pages != slab or st.count(
            DATA, first, first + count
        ) != count:
            return False
        c = self._slab_clients[slab][0]
        if count > c.max_batch:
            return False
        ra = self.readahead
        if ra.windows and ra.hit(first, count, out, done, tag):
            return True

        def loaded(exc: BaseException | None) -> None:
            try:
                ok = exc is None and not self._bad_pages(first, count, out)
            except Exception as e:  # never leave the request unanswered
                ok, exc = False, e
            if ok:
                stats = self.stats
                stats["loads"] += 1
                stats["pages_loaded"] += count
                done(tag, None)
            elif exc is None or isinstance(exc, _FAILURES):
                done(tag, self.load_verified(slab, first, count, out))
            else:
                done(tag, exc)

        keys = (first,) if count == 1 else tuple(range(first, first + count))
        if not c.load_cb(keys, out, loaded):
            return False
        try:  # the request is on its way: fetching ahead must not fail it
            ra.missed(first, count)
        except Exception:
            log.exception("readahead failed; reading on without it")
        return True

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        """The common write (one slab, one replica, no repair copying it): one STORE whose
        acknowledgement marks the pages from the receive path. Any failure continues in
        `_store`, which sends it again (STORE is idempotent) and decides what it means."""
        n = len(data)
        assert not (offset | n) & _MASK, f"unaligned request ({offset}, {n})"
        if not self._open:
            return False
        first, count = offset >> 12, n >> 12
        slab = first // self.slab_pages
        c = self._lone_replica(slab, count)
        if c is None or (first + count - 1) // self.slab_pages != slab:
            return False
        inflight = self.inflight
        crcs: list[array] = []  # the pages' checksums, once computed (see below)

        def stored(exc: BaseException | None) -> None:
            inflight[slab] -= 1
            if exc is None:
                try:
                    self._mark_stored(first, count, data, crcs[0] if crcs else None)
                except Exception as e:  # never leave the request unanswered
                    done(tag, e)
                    return
                done(tag, None)
            elif isinstance(exc, _FAILURES):
                done(tag, self._store(slab, first, count, data))
            else:
                done(tag, exc)

        keys = (first,) if count == 1 else tuple(range(first, first + count))
        inflight[slab] += 1  # a repair starting now waits for this write to finish
        if c.store_cb(keys, data, stored):
            if count > 1:
                # Needed only at the acknowledgement, so computed once the STORE has left
                # (this callback normally runs right after the send), while the memserver
                # copies the pages, instead of after it answered: for 512 KiB that is about
                # 40% of the daemon's work per write taken off the write's latency. Should the
                # acknowledgement come first, `stored` computes them itself (D29).
                c.loop.call_soon(lambda: crcs.append(page_crcs(data, count)))
            return True
        inflight[slab] -= 1
        return False

    def pages_match(self, first: int, count: int, buf: memoryview) -> bool:
        """True when every page holds data and `buf` passes the checks of any load."""
        if self._state.count(DATA, first, first + count) != count:
            return False
        return not self._bad_pages(first, count, buf)

    def _lone_replica(self, slab: int, count: int) -> MemClient | None:
        """The slab's only replica when one STORE of `count` pages can go straight to it (no
        replication, no repair copying the slab), else None: the general path decides."""
        clients = self._slab_clients[slab]
        if len(clients) != 1 or slab in self.repairs or count > clients[0].max_batch:
            return None
        return clients[0]

    def _mark_stored(
        self, first: int, count: int, data: memoryview, crcs: array | None = None
    ) -> None:
        """Every live replica acknowledged these pages: they hold `data` (whose page
        checksums are `crcs`, when already computed) from now on."""
        self.readahead.invalidate(first, count)
        stats = self.stats
        stats["stores"] += 1
        stats["pages_stored"] += count
        st, crc = self._state, self._crc
        if count == 1:
            crc[first] = _crc32(data)
            st[first] = DATA
        else:
            crc[first : first + count] = page_crcs(data, count) if crcs is None else crcs
            st[first : first + count] = bytes((DATA,)) * count

    async def read(self, offset: int, out: memoryview) -> None:
        n = len(out)
        if (offset | n) & _MASK or not self._open:
            self._check(offset, n)
        first, count, st = offset >> 12, n >> 12, self._state
        slab = first // self.slab_pages
        if (count == 1 and st[first] == DATA) or (
            (first + count - 1) // self.slab_pages == slab
            and st.count(DATA, first, first + count) == count
        ):
            # The common case (written pages, one slab): one LOAD from the preferred replica,
            # no extra coroutine frames. Anything unusual (a failure, a bad checksum) goes
            # through load_verified, which loads again with failover and judges the replicas.
            c = self._slab_clients[slab][0]
            if c.hello is not None and count <= c.max_batch:
                try:
                    await c.load_batch(
                        (first,) if count == 1 else tuple(range(first, first + count)), out
                    )
                except _FAILURES:
                    pass
                else:
                    if not self._bad_pages(first, count, out):
                        stats = self.stats
                        stats["loads"] += 1
                        stats["pages_loaded"] += count
                        return
            await self.load_verified(slab, first, count, out)
            return
        if count == 1:
            s = st[first]
            if s == EMPTY:
                out[:] = _ZERO_PAGE
                self.stats["zero_reads"] += 1
            else:
                self._lost_error(first, 1)
            return
        if st.find(LOST, first, first + count) >= 0:
            self._lost_error(first, count)
        parts, p, end = [], first, first + count
        while p < end:
            q = st.find(DATA, p, end)
            q = end if q < 0 else q
            self._zero(out, (p - first) * PAGE_SIZE, (q - first) * PAGE_SIZE)
            if q == end:
                break
            r = st.find(EMPTY, q, end)
            r = end if r < 0 else r
            for slab, s, k in self._runs(q, r - q):
                a = (s - first) * PAGE_SIZE
                parts.append(self.load_verified(slab, s, k, out[a : a + k * PAGE_SIZE]))
            p = r
        if parts:
            await self._all(parts)

    def _lost_error(self, first: int, count: int) -> None:
        self.stats["read_errors"] += 1
        raise StorageError(
            errno.EIO,
            f"pages in {first}..{first + count - 1} were lost by "
            "every replica (memserver restarted, or a write failed everywhere)",
        )

    def _zero(self, out: memoryview, a: int, b: int) -> None:
        if a < b:
            self.stats["zero_reads"] += 1
        while a < b:
            n = min(b - a, len(_ZEROS))
            out[a : a + n] = _ZEROS[:n]
            a += n

    @staticmethod
    async def _load_one(client: MemClient, keys: tuple[int, ...], out: memoryview) -> None:
        if client.hello is not None and len(keys) <= client.max_batch:
            try:
                await client.load_batch(keys, out)
                return
            except MemserverUnreachable:
                pass  # load() below reconnects (if the breaker allows) and retries
        await client.load(keys, out)

    def _bad_pages(self, first: int, count: int, out: memoryview) -> list[int]:
        """The loaded pages that fail their checksum (pages not holding DATA any more,
        trimmed while the LOAD was in flight, are not judged; bytes of a replicated write
        still in flight, which a racing read may see on one replica, are not bad)."""
        crc, st = self._crc, self._state
        if count == 1:
            bad = [first] if st[first] == DATA and _crc32(out) != crc[first] else []
        else:
            got = page_crcs(out, count)
            if got == crc[first : first + count]:  # the common case, compared in C
                return []
            bad = [
                first + k
                for k in range(count)
                if st[first + k] == DATA and got[k] != crc[first + k]
            ]
        if bad and self._pending_writes:
            bad = [
                p
                for p in bad
                if not self._in_flight_bytes(p, out[(p - first) << 12 : (p - first + 1) << 12])
            ]
        return bad

    def _in_flight_bytes(self, page: int, got: memoryview) -> bool:
        """`got` is page `page` as a replicated write still in flight writes it."""
        return any(
            f <= page < f + n and got == d[(page - f) << 12 : (page - f + 1) << 12]
            for f, n, d in self._pending_writes
        )

    async def load_verified(self, slab: int, first: int, count: int, out: memoryview) -> None:
        """LOAD pages from the slab's replicas until one returns bytes matching every page's
        checksum. Drops replicas with missing or bad pages; raises EIO if none is good."""
        self.stats["loads"] += 1
        self.stats["pages_loaded"] += count
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        wait = _UnreachableWait(self)
        while True:
            unreachable, bad, bad_everywhere = await self._load_round(slab, first, count, keys, out)
            if unreachable is None:
                return
            # a replica may come back: wait, then try again
            if unreachable and self._open and await wait.again():
                continue
            break
        self.stats["read_errors"] += 1
        what = f"reading pages {first}..{first + count - 1}"
        if not unreachable:  # every replica answered and none had good bytes: gone for good
            for p in sorted(bad_everywhere):
                self._mark_lost(p, 1)
            raise StorageError(
                errno.EIO, f"{what}: pages were lost by every replica: " + "; ".join(bad)
            )
        raise StorageError(
            errno.EIO,
            f"{what}: no replica answered with good bytes within "
            f"{self.unreachable_wait:.0f} s: " + "; ".join(unreachable + bad),
        )

    async def _load_round(
        self, slab: int, first: int, count: int, keys: tuple[int, ...], out: memoryview
    ) -> tuple:
        """Try each replica once. Returns (None, ...) on success, else the reasons."""
        members = self.sets[slab]
        clients = self._slab_clients[slab]
        unreachable: list[str] = []
        bad: list[str] = []
        bad_everywhere = set(range(first, first + count))  # bad on every replica that answered
        for idx, client in zip(list(members), clients, strict=True):
            try:
                await self._load_one(client, keys, out)
            except MemserverUnreachable as e:
                self.stats["failovers"] += 1
                unreachable.append(str(e))
                continue
            except PageServerError as e:
                if e.code != ErrorCode.NOT_FOUND:
                    self.stats["failovers"] += 1
                    unreachable.append(str(e))
                    continue
                bad.append(f"{client.peer}: pages missing")
                self.drop_replica(slab, idx, "pages missing")
                continue
            bad_pages = self._bad_pages(first, count, out)
            if not bad_pages:
                return None, None, None
            nbad = len(bad_pages)
            bad_everywhere.intersection_update(bad_pages)
            self.stats["checksum_failures"] += nbad
            bad.append(f"{client.peer}: {nbad} page(s) with bad checksums")
            log.error("slab %d: %d page(s) from %s failed their checksum", slab, nbad, client.peer)
            self.drop_replica(slab, idx, "bad checksum")
        return unreachable, bad, bad_everywhere

    async def write(self, offset: int, data: memoryview) -> None:
        n = len(data)
        if (offset | n) & _MASK or not self._open:
            self._check(offset, n)
        first, count = offset >> 12, n >> 12
        slab = first // self.slab_pages
        if (first + count - 1) // self.slab_pages == slab:  # within one slab: no splitting
            c = self._lone_replica(slab, count)
            if c is not None and c.hello is not None:
                # The common case without replication: one STORE awaited right here. On any
                # failure the general path below sends it again (STORE is idempotent) and
                # decides what the failure means (ENOSPC, EIO, pages lost).
                inflight = self.inflight
                inflight[slab] += 1  # a repair starting now waits for this write to finish
                try:
                    await c.store_batch(
                        (first,) if count == 1 else tuple(range(first, first + count)), data
                    )
                    ok = True
                except _FAILURES:
                    ok = False
                finally:
                    inflight[slab] -= 1
                if ok:
                    self._mark_stored(first, count, data)
                    return
            await self._store(slab, first, count, data)
            return
        parts = []
        for slab, s, k in self._runs(first, count):
            a = (s - first) * PAGE_SIZE
            parts.append(self._store(slab, s, k, data[a : a + k * PAGE_SIZE]))
        await self._all(parts)

    @staticmethod
    def _start_store(
        client: MemClient, keys: tuple[int, ...], data: memoryview
    ) -> Awaitable[Any] | None:
        """Queue the STORE at once when the client is connected (it leaves with this loop
        iteration's sends); None when `_store_one` has to connect first."""
        if client.hello is not None and len(keys) <= client.max_batch:
            return client.store_batch(keys, data)
        return None

    @staticmethod
    async def _store_one(
        client: MemClient,
        keys: tuple[int, ...],
        data: memoryview,
        started: Awaitable[Any] | None = None,
    ) -> None:
        if started is None:
            started = RemoteStore._start_store(client, keys, data)
        if started is not None:
            try:
                await started
                return
            except MemserverUnreachable:
                pass  # store() below reconnects (if the breaker allows) and retries
        await client.store(keys, data)

    async def _store(self, slab: int, first: int, count: int, data: memoryview) -> None:
        rep = self.repairs.get(slab)
        if rep is None:
            inflight = self.inflight
            inflight[slab] += 1  # a repair starting now waits for this write to finish
            try:
                await self._store_replicas(slab, first, count, data, None)
            finally:
                inflight[slab] -= 1
            return
        async with rep.lock:  # the copier holds it per chunk: no copy overwrites this write
            await self._store_replicas(slab, first, count, data, rep)

    async def _store_replicas(
        self, slab: int, first: int, count: int, data: memoryview, rep: SlabRepair | None
    ) -> None:
        self.stats["stores"] += 1
        self.stats["pages_stored"] += count
        wait = _UnreachableWait(self)
        while True:
            err = await self._store_round(slab, first, count, data, rep)
            if err is None:
                return
            # a replica may come back: wait, then try again
            if isinstance(err, MemserverUnreachable) and self._open and await wait.again():
                continue
            break
        self.stats["write_errors"] += 1
        what = f"writing pages {first}..{first + count - 1}"
        if isinstance(err, PageServerError) and err.code == ErrorCode.NO_SPACE:
            raise _storage_error(err, what) from None  # refused everywhere: old bytes remain
        self._mark_lost(first, count)  # replicas may disagree now: never serve either
        raise _storage_error(err, what) from None

    async def _store_round(
        self, slab: int, first: int, count: int, data: memoryview, rep: SlabRepair | None
    ) -> Exception | None:
        """Store on every replica once. None when at least one stored it (the others are
        dropped); else the failure to act on: NO_SPACE only if every replica refused for
        space, MemserverUnreachable if any could not be reached."""
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        members = list(self.sets[slab])
        clients = self._slab_clients[slab]
        if len(clients) == 1 and rep is None:
            crcs = (_crc32(data),) if count == 1 else page_crcs(data, count)
            try:
                await self._store_one(clients[0], keys, data)
                results: list = [None]
            except _FAILURES as e:
                results = [e]
        else:
            targets = list(clients)
            if rep is not None and not rep.aborted:
                targets.append(self.clients[rep.target])
            # Until every replica answers, a read that races this write may already get the
            # new bytes from one of them: they are not corruption (see _bad_pages). The pages
            # are registered before any STORE can leave.
            pending = self._pending_writes
            entry = (first, count, data)
            pending.append(entry)
            started: list[Awaitable[Any] | None] = []
            try:
                started = [self._start_store(c, keys, data) for c in targets]
                if count > 1 and any(s is not None for s in started):
                    await asyncio.sleep(0)  # the STOREs leave: checksum while they are copied
                crcs = (_crc32(data),) if count == 1 else page_crcs(data, count)
                results = await asyncio.gather(
                    *[
                        self._store_one(c, keys, data, s)
                        for c, s in zip(targets, started, strict=True)
                    ],
                    return_exceptions=True,
                )
            except BaseException:  # closed or cancelled: the started STOREs have no waiter
                for f in started:
                    if isinstance(f, asyncio.Future):
                        if not f.done():
                            f.cancel()
                        elif not f.cancelled():
                            f.exception()  # retrieved: no "never retrieved" warning
                raise
            finally:  # by identity: another write may carry equal bytes
                del pending[next(i for i, e in enumerate(pending) if e is entry)]
            if len(results) > len(members):
                r = results.pop()
                if isinstance(r, BaseException):
                    rep.aborted = f"writing to the new replica failed: {r}"
        failed = [
            (i, r) for i, r in zip(members, results, strict=True) if isinstance(r, BaseException)
        ]
        for _, r in failed:
            if not isinstance(r, _FAILURES):
                raise r  # a bug or cancellation, not a replica failure
        if len(failed) < len(members):  # stored by at least one replica: those are the truth
            for i, r in failed:
                self.drop_replica(slab, i, f"write failed: {r}")
            self.readahead.invalidate(first, count)
            st, crc = self._state, self._crc
            for k in range(count):
                crc[first + k] = crcs[k]
                st[first + k] = DATA
            return None
        errs = [r for _, r in failed]
        unreachable = [r for r in errs if isinstance(r, MemserverUnreachable)]
        if unreachable:
            return unreachable[0]
        nospace = [
            r for r in errs if isinstance(r, PageServerError) and r.code == ErrorCode.NO_SPACE
        ]
        return errs[0] if len(nospace) < len(errs) else nospace[0]

    async def trim(self, offset: int, length: int) -> None:
        self._check(offset, length)
        first, count = offset // PAGE_SIZE, length // PAGE_SIZE
        st, end = self._state, first + count
        slabs: dict[int, list[int]] = {}
        p = first
        while p < end:
            q = st.find(EMPTY, p, end)
            q = end if q < 0 else q
            for slab, s, n in self._runs(p, q - p):
                slabs.setdefault(slab, []).extend(range(s, s + n))
            if q == end:
                break
            q2 = [st.find(DATA, q, end), st.find(LOST, q, end)]
            q2 = [x for x in q2 if x >= 0]
            p = min(q2) if q2 else end
        self.readahead.invalidate(first, count)
        st[first:end] = bytes(count)  # reads during the FREE see zeros, as they will after
        if not slabs:
            return
        await asyncio.gather(*(self._free_slab(slab, keys) for slab, keys in slabs.items()))
        # A STORE sent before this FREE on the same connection was acknowledged before it;
        # clear again so such a write's mark does not outlive the page it refers to.
        self.readahead.invalidate(first, count)
        st[first:end] = bytes(count)
        self.stats["pages_freed"] += sum(len(k) for k in slabs.values())

    async def _free_slab(self, slab: int, keys: list[int]) -> None:
        """FREE on every replica. A replica that cannot free is dropped (its stale pages would
        hold capacity); the trim itself succeeds, since the pages read as zeros from now on."""
        rep = self.repairs.get(slab)
        if rep is not None:
            async with rep.lock:
                await self._free_replicas(slab, keys, rep)
        else:
            self.inflight[slab] += 1
            try:
                await self._free_replicas(slab, keys, None)
            finally:
                self.inflight[slab] -= 1

    async def _free_replicas(self, slab: int, keys: list[int], rep: SlabRepair | None) -> None:
        members = list(self.sets[slab])
        targets = [*members, rep.target] if rep is not None and not rep.aborted else members
        res = await asyncio.gather(
            *(self.clients[i].free(keys) for i in targets), return_exceptions=True
        )
        self.stats["frees"] += len(targets)
        for i, r in zip(targets, res, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, _FAILURES):
                    raise r
                if rep is not None and i == rep.target:
                    rep.aborted = f"freeing on the new replica failed: {r}"
                else:
                    self.drop_replica(slab, i, f"free failed: {r}")
