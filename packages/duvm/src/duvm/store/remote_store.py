"""`RemoteStore`: a BlockStore whose pages live in memservers' RAM, replicated and checked.

Usage (the NBD daemon does exactly this)::

    store = await RemoteStore.open([("10.0.0.2", 7070), ("10.0.0.3", 7070)],
                                   size=4 << 30, client_id="node1:/dev/nbd0:1732900000",
                                   replicas=2)
    await store.write(0, memoryview(page))      # BlockStore interface, page-aligned
    store.health()                              # degraded slabs, repairs, failovers (JSON-ready)
    await store.close()                         # RELEASEs the pages on every memserver

Theory of operation, and where each part lives. The store is composed of components, each
the one owner of its state and its counters (`counters.Counters`); they share no state but
the `Replication` and its `SlabTable`, and the store only wires them and forwards the
BlockStore interface to them:

- `slab_table.SlabTable`: the export cut into slabs of `slab_pages` pages; per page a state
  byte and the CRC-32C of the bytes last acknowledged; per slab its live replica set.
- `replication.Replication`: every change to a slab's replica set (drop, add, replace a lost
  slab, a memserver that lost our namespace), the room reserved and assigned on each peer,
  the copies under repair, and whether the export is open.
- Here: setup. Before the export is offered, every slab is placed on `replicas` distinct
  memservers (`placement.place`: power of two choices on free room, never two replicas on one
  memserver) and each memserver RESERVEs the pages of its slabs. Reserve before exposing: a
  write the kernel sends always has somewhere to go. When a memserver comes back without our
  namespace (it restarted), `Replication.namespace_lost` drops it from every slab that has
  another replica; slabs where it was the only one keep it (the reservation is restored) and
  their written pages are marked lost.
- `remote_write.RemoteWrites`: STORE on every live replica, acknowledged when all of them
  stored it; failed replicas are dropped; ENOSPC or EIO (pages lost) when none stored it.
- `remote_read.RemoteReads`: LOAD from the first replica that answers, every page verified;
  failover, and replicas with missing or bad pages dropped. It owns the
  `readahead.Readahead`: sequential swap-in reads served from windows fetched early.
- `remote_trim.RemoteTrims`: trimmed pages read as zeros and are FREEd everywhere.
- `remote_health.RemoteHealth`: the watchdog (stalled connections aborted, dropped peers
  probed), the log summary, and the report behind `health()`.
- `repair.Repairer`: a background task that restores R for degraded slabs; while a slab is
  being copied, writes and trims to it also go to the new replica, under a per-slab lock.
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

from duvm.store.counters import merge
from duvm.store.memclient import MemClient
from duvm.store.placement import normalize_peers, place
from duvm.store.readahead import Readahead
from duvm.store.remote_health import DEFAULT_OP_TIMEOUT, RemoteHealth
from duvm.store.remote_read import RemoteReads
from duvm.store.remote_trim import RemoteTrims
from duvm.store.remote_write import PageCrcs, RemoteWrites
from duvm.store.repair import Repairer
from duvm.store.replica_errors import DEFAULT_UNREACHABLE_WAIT, REPLICA_FAILURES, storage_error
from duvm.store.replication import Replication
from duvm.store.slab_table import page_crcs, slab_table_type
from duvm.store.storage import (
    PAGE_SIZE,
    Batching,
    BlockStore,
    Capabilities,
    Done,
    FastEntry,
    ReplicationHealth,
    StorageError,
)
from duvm.wire.auth import PeerSecurity

log = logging.getLogger(__name__)

DEFAULT_SLAB_PAGES = 256  # 1 MiB slabs: fine-grained placement, big enough for batched I/O
_MASK = PAGE_SIZE - 1


class RemoteStore(BlockStore):
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
        transports: list[str] | None = None,
        write_crcs: PageCrcs = page_crcs,
    ) -> None:
        """`write_crcs` checksums the pages of a write of several pages (see RemoteWrites)."""
        if size <= 0 or size & _MASK:
            raise ValueError(f"size must be a positive multiple of {PAGE_SIZE}, not {size}")
        if not peers:
            raise ValueError("at least one memserver is needed")
        peers = normalize_peers(peers)
        if slab_pages < 1:
            raise ValueError("slab_pages must be positive")
        transports = transports or ["tcp"] * len(peers)
        if len(transports) != len(peers):
            raise ValueError("one transport per peer")
        if not 1 <= replicas <= len(peers):
            raise ValueError(f"replicas must be 1..{len(peers)} (the number of peers)")
        self.size = size
        self.client_id = client_id
        self.batching = Batching()  # shared by its connections and the NBD server
        self.clients = [
            MemClient(
                h,
                p,
                client_id,
                connect_timeout=connect_timeout,
                security=security,
                batching=self.batching,
                transport=t,
                chunk_pages=slab_pages,  # an RDMA chunk is a slab: one region run per slab
            )
            for (h, p), t in zip(peers, transports, strict=True)
        ]
        self.table = slab_table_type()(size // PAGE_SIZE, slab_pages, self.clients, tables)
        self.replication = Replication(self.table, self.clients, replicas, random.Random(seed))
        for c in self.clients:
            c.on_namespace_lost = self.replication.namespace_lost
        self.reads = RemoteReads(self.replication, unreachable_wait)
        self.writes = RemoteWrites(self.replication, unreachable_wait, write_crcs)
        self.trims = RemoteTrims(self.replication)
        self.monitor = RemoteHealth(self.replication, op_timeout=op_timeout)
        self._tasks: list[asyncio.Task] = []
        self._want_repair = repair

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
            placement = place(sizes, room, self.replicas, self.replication.rng)
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

    async def open_connections(self, placement: list[list[int]]) -> None:
        """Connect (HELLO, AUTH) every peer not connected yet, and nothing more: no RELEASE, no
        reservation, no watchdog or repair. A standby daemon opens its connections this way
        while the daemon it stands in for still serves: the namespaces are joined, not changed
        (a memserver lets several connections of one token share a namespace, and keeps it out
        of its lease while any is open). A peer that cannot be reached is left to the running
        store's reconnects, as long as every slab of `placement` has a replica on a peer that
        could be; else StorageError (every connection is closed then, never released: the
        pages belong to a live device)."""
        pending = [c for c in self.clients if not c.connected]
        results = await asyncio.gather(*(c.connect() for c in pending), return_exceptions=True)
        failed = [
            f"{c.peer} ({r})"
            for c, r in zip(pending, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if not failed:
            return
        up = {i for i, c in enumerate(self.clients) if c.connected}
        if all(up.intersection(p) for p in placement):
            log.warning(
                "memserver unreachable, its copies are read from the others: %s", "; ".join(failed)
            )
            return
        for c in self.clients:
            await c.close()  # never RELEASE here: the pages belong to a live device
        raise StorageError(errno.EHOSTUNREACH, "memserver unreachable: " + "; ".join(failed))

    async def reattach(self, placement: list[list[int]]) -> None:
        """Take over the namespaces a crashed predecessor left (same client id and token, and
        this store built on its persisted page tables) with its slab map `placement`. Nothing
        is released: the memservers keep the pages for their lease. A memserver that lost the
        namespace meanwhile is handled as on a reconnect (`Replication.namespace_lost`).
        Connections already open (`open_connections`, a standby's) are kept."""
        if len(placement) != self.table.nslabs or any(
            not p or len(set(p)) != len(p) or not all(0 <= i < len(self.clients) for i in p)
            for p in placement
        ):
            raise ValueError(
                f"placement must name 1+ distinct peers for each of {self.table.nslabs} slabs"
            )
        await self.open_connections(placement)
        want = [0] * len(self.clients)
        for slab, peers in enumerate(placement):
            for i in peers:
                want[i] += self.table.slab_size(slab)
        self._begin(placement, want)
        for c in self.clients:
            if c.hello is not None and not c.hello.resumed:
                self.replication.namespace_lost(c)
        res = await asyncio.gather(
            *(
                c.reserve(n)
                for c, n in zip(self.clients, want, strict=True)
                if n and c.connected  # an unreachable one: restored when it reconnects
            ),
            return_exceptions=True,
        )
        for r in res:
            if isinstance(r, BaseException):
                log.error("reserving on resume failed: %s", r)

    def _begin(self, placement: list[list[int]], want: list[int]) -> None:
        self.replication.begin(placement, want)
        self._tasks.append(asyncio.ensure_future(self.monitor.watchdog()))
        if self._want_repair:
            repairer = Repairer(self.replication, self.reads.load_verified)
            self.monitor.repairer = repairer
            self.replication.on_dropped = repairer.wake
            self._tasks.append(asyncio.ensure_future(repairer.run()))
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
        if not self.replication.open:
            return
        await self._stop_serving()
        self.table.forget()
        await self._abandon()

    async def _stop_serving(self) -> None:
        """No more requests: the watchdog, probes and repair stopped, the readahead dropped."""
        self.replication.open = False
        tasks = [*self._tasks, *self.monitor.probes]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self.reads.readahead.clear()

    async def close(self) -> None:
        """Release the pages on every memserver and close the connections."""
        await self.release()

    async def detach(self) -> None:
        """Stop serving and close the connections, freeing nothing: a worker of a daemon with
        several (`duvm daemon --workers`) leaves the pages to worker 0, which releases them."""
        await self._stop_serving()
        for c in self.clients:
            await c.close()

    async def peer_status(self) -> list[dict | None]:
        """Each memserver's STATUS (None for a peer that cannot answer)."""
        res = await asyncio.gather(*(c.status() for c in self.clients), return_exceptions=True)
        return [None if isinstance(r, BaseException) else r for r in res]

    # --- the BlockStore interface: each request path is its own component ---

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        return self.reads.fast.start_read(offset, out, done, tag)

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        return self.writes.fan_out.start_write(offset, data, done, tag)

    def fast_entries(self) -> tuple[FastEntry, FastEntry]:
        return self.reads.fast.start_read, self.writes.fan_out.start_write

    async def read(self, offset: int, out: memoryview) -> None:
        await self.reads.read(offset, out)

    async def write(self, offset: int, data: memoryview) -> None:
        await self.writes.write(offset, data)

    async def trim(self, offset: int, length: int) -> None:
        await self.trims.trim(offset, length)

    # --- what status and metrics read ---

    @property
    def replicas(self) -> int:
        """Copies wanted per slab (`Replication.want`)."""
        return self.replication.want

    @property
    def readahead(self) -> Readahead:
        return self.reads.readahead

    @property
    def repairer(self) -> Repairer | None:
        return self.monitor.repairer

    def counters(self) -> dict[str, int]:
        """Every component's counters, merged (`counters.merge`)."""
        parts = [
            self.reads.counters,
            self.reads.readahead.counters,
            self.writes.counters,
            self.trims.counters,
            self.table.counters,
            self.replication.counters,
            self.monitor.counters,
        ]
        if self.monitor.repairer is not None:
            parts.append(self.monitor.repairer.counters)
        return merge(*(c.snapshot() for c in parts))

    def health(self) -> ReplicationHealth:
        """Replication state for `duvm status` and metrics (JSON-ready)."""
        return self.monitor.health()

    def degraded_slabs(self) -> list[int]:
        """Slabs with fewer live replicas than wanted."""
        return self.replication.degraded_slabs()

    def pages_per_peer(self) -> list[int]:
        """Written pages held by each peer (a page counts once per replica)."""
        return self.table.pages_per_peer()
