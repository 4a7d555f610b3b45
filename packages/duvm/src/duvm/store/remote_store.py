"""`RemoteStore`: a BlockStore whose pages live in memservers' RAM, replicated and checked.

Usage (the NBD daemon does exactly this)::

    store = await RemoteStore.open([("10.0.0.2", 7070), ("10.0.0.3", 7070)],
                                   size=4 << 30, client_id="node1:/dev/nbd0:1732900000",
                                   replicas=2)
    await store.write(0, memoryview(page))      # BlockStore interface, page-aligned
    store.health()                              # degraded slabs, repairs, failovers (JSON-ready)
    await store.close()                         # RELEASEs the pages on every memserver

Theory of operation, and where each part lives:

- `slab_table.SlabTable`: the export cut into slabs of `slab_pages` pages; per page a state
  byte and the CRC-32C of the bytes last acknowledged; per slab its live replica set.
- Here: setup and the replica sets' bookkeeping. Before the export is offered, every slab is
  placed on `replicas` distinct memservers (`placement.place`: power of two choices on free
  room, never two replicas on one memserver) and each memserver RESERVEs the pages of its
  slabs. Reserve before exposing: a write the kernel sends always has somewhere to go. When a
  memserver comes back without our namespace (it restarted), `_namespace_lost` drops it from
  every slab that has another replica; slabs where it was the only one keep it (the
  reservation is restored) and their written pages are marked lost.
- `remote_write.RemoteWrites`: STORE on every live replica, acknowledged when all of them
  stored it; failed replicas are dropped; ENOSPC or EIO (pages lost) when none stored it.
- `remote_read.RemoteReads`: LOAD from the first replica that answers, every page verified;
  failover, and replicas with missing or bad pages dropped.
- `remote_trim.RemoteTrims`: trimmed pages read as zeros and are FREEd everywhere.
- `remote_health.RemoteHealth`: the watchdog (stalled connections aborted, dropped peers
  probed), the log summary, and `health()`.
- `repair.Repairer`: a background task that restores R for degraded slabs; while a slab is
  being copied, writes and trims to it also go to the new replica, under a per-slab lock.
- `readahead.Readahead`: sequential swap-in reads served from windows fetched early.
- `replica_errors`: what counts as a replica failure, and the wait (`unreachable_wait`, 50 s)
  while no replica of a slab answers: for swap a stall beats an error, up to a limit.
- Requests arrive validated: the NBD layer advertises a 4096-byte minimum block and refuses
  anything unaligned or past the end with EINVAL (`nbdproto.validate`); here alignment is only
  asserted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
from typing import Any

from duvm.base.quietlog import QuietLog
from duvm.store.memclient import MemClient
from duvm.store.placement import normalize_peers, place
from duvm.store.readahead import Readahead
from duvm.store.remote_health import DEFAULT_OP_TIMEOUT, DEFAULT_SUMMARY_EVERY, RemoteHealth
from duvm.store.remote_read import RemoteReads
from duvm.store.remote_trim import RemoteTrims
from duvm.store.remote_write import RemoteWrites
from duvm.store.repair import Repairer, SlabRepair
from duvm.store.replica_errors import DEFAULT_UNREACHABLE_WAIT, REPLICA_FAILURES, storage_error
from duvm.store.slab_table import SlabTable
from duvm.store.storage import PAGE_SIZE, Batching, BlockStore, Capabilities, StorageError
from duvm.wire.auth import PeerSecurity

log = logging.getLogger(__name__)

DEFAULT_SLAB_PAGES = 256  # 1 MiB slabs: fine-grained placement, big enough for batched I/O
_MASK = PAGE_SIZE - 1


class RemoteStore(RemoteReads, RemoteWrites, RemoteTrims, RemoteHealth, BlockStore):
    """`size` bytes (a multiple of 4096) on the memservers `peers`, in namespace `client_id`."""

    capabilities = Capabilities()
    fast_path = True  # start_read/start_write (remote_read, remote_write)

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
        self.client_id = client_id
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
        self.table = SlabTable(size // PAGE_SIZE, slab_pages, self.clients, self.stats, tables)
        self.rng = random.Random(seed)
        self.repairs: dict[int, SlabRepair] = {}  # slab -> copy in progress
        self.reserved = [0] * len(self.clients)  # pages we reserved on each peer
        self.assigned = [0] * len(self.clients)  # pages of slabs placed (or copying) there
        # (peer, slab): a dropped copy that may still hold pages there (counted in assigned)
        self.stale: set[tuple[int, int]] = set()
        self._open = False
        self._tasks: list[asyncio.Task] = []
        self._probes: set[asyncio.Task] = set()  # background reconnect attempts
        self._want_repair = repair
        self.repairer: Repairer | None = None
        self.readahead = Readahead(self.table, self.stats, self.read)
        self.table.on_change = self.readahead.invalidate
        self.events = QuietLog(log)  # failover messages: one line per kind, then counts
        self.summary_every = DEFAULT_SUMMARY_EVERY
        self._was_degraded = False

    @classmethod
    async def open(
        cls, peers: list[tuple[str, int]], size: int, client_id: str, **kwargs: object
    ) -> RemoteStore:
        """Build, connect and reserve; see `connect`."""
        store = cls(peers, size, client_id, **kwargs)  # type: ignore[arg-type]
        await store.connect()
        return store

    @property
    def pages(self) -> int:
        return self.table.pages

    @property
    def placement(self) -> list[tuple[int, ...]]:
        """Each slab's live replica set (peer indices)."""
        return [tuple(s) for s in self.table.sets]

    def describe(self) -> str:
        return f"{len(self.clients)} memserver(s)"

    def memserver_clients(self) -> list[MemClient]:
        return list(self.clients)

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
            sizes = [self.table.slab_size(s) for s in range(self.table.nslabs)]
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
                raise storage_error(errs[0], "reserving capacity failed")
        except BaseException:
            await self._abandon()
            raise
        self._begin(placement, want)

    async def reattach(self, placement: list[list[int]]) -> None:
        """Take over the namespaces a crashed predecessor left (same client id and token, and
        this store built on its persisted page tables) with its slab map `placement`. Nothing
        is released: the memservers keep the pages for their lease. A memserver that lost the
        namespace meanwhile is handled as on a reconnect (`_namespace_lost`)."""
        if len(placement) != self.table.nslabs or any(
            not p or len(set(p)) != len(p) or not all(0 <= i < len(self.clients) for i in p)
            for p in placement
        ):
            raise ValueError(
                f"placement must name 1+ distinct peers for each of {self.table.nslabs} slabs"
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
                want[i] += self.table.slab_size(slab)
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
        self.table.assign(placement)
        self._open = True
        self._tasks.append(asyncio.ensure_future(self._watchdog()))
        if self._want_repair:
            self.repairer = Repairer(self)
            self._tasks.append(asyncio.ensure_future(self.repairer.run()))
        log.info(
            "export of %d pages reserved as %d slabs on %d memservers (R=%d)",
            self.pages,
            self.table.nslabs,
            len(self.clients),
            self.replicas,
        )

    async def _abandon(self) -> None:
        for c in self.clients:
            if c.connected:
                try:
                    await c.release()
                except REPLICA_FAILURES as e:
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
        self.table.forget()
        self.readahead.clear()
        await self._abandon()

    async def close(self) -> None:
        """Release the pages on every memserver and close the connections."""
        await self.release()

    async def peer_status(self) -> list[dict | None]:
        """Each memserver's STATUS (None for a peer that cannot answer)."""
        res = await asyncio.gather(*(c.status() for c in self.clients), return_exceptions=True)
        return [None if isinstance(r, BaseException) else r for r in res]

    # --- replica bookkeeping ---

    def drop_replica(self, slab: int, peer: int, why: str) -> bool:
        """Remove `peer` from the slab's replicas unless it is the last one. True if removed."""
        members = self.table.sets[slab]
        if peer not in members or len(members) == 1:
            return False
        self.table.set_replicas(slab, [i for i in members if i != peer])
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
        self.table.set_replicas(slab, [*self.table.sets[slab], peer])

    def replace_lost_slab(self, slab: int, target: int) -> None:
        """Every replica of the slab is gone for good: its written pages are lost (reads fail
        with EIO until rewritten) and `target` (already counted in `assigned`) holds it from
        now on, so writes to it succeed again."""
        first, n = slab * self.table.slab_pages, self.table.slab_size(slab)
        self.table.mark_lost(first, n)
        for i in self.table.sets[slab]:
            self.assigned[i] -= n
        gone = ", ".join(c.peer for c in self.table.slab_clients[slab])
        self.events.event(
            ("lost", gone),
            logging.ERROR,
            "slab %d: every replica is gone (%s); its written pages are lost "
            "(reads fail with EIO), new writes go to %s",
            slab,
            gone,
            self.clients[target].peer,
        )
        self.table.set_replicas(slab, [target])

    def _namespace_lost(self, client: MemClient) -> None:
        """A memserver came back without our namespace: its copies are gone."""
        peer = self._index[client]
        for slab, members in enumerate(self.table.sets):
            if peer not in members:
                continue
            if not self.drop_replica(slab, peer, "its memserver lost our pages"):
                first = slab * self.table.slab_pages
                self.table.mark_lost(first, self.table.slab_size(slab))
        for p, slab in [x for x in self.stale if x[0] == peer]:  # those pages are gone too
            self.stale.discard((p, slab))
            self.assigned[p] -= self.table.slab_size(slab)
        for rep in self.repairs.values():
            if rep.target == peer:
                rep.aborted = "the new replica's memserver lost our pages"
