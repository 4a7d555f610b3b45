"""Writes of a `RemoteStore`: STORE on every live replica of the slab at once.

- A write is acknowledged only when every live replica stored it. A replica that fails
  (unreachable, stalled, refused) is dropped from the slab, which is then degraded, and the
  write is acknowledged by the survivors.
- If no replica stored it, the write fails: with ENOSPC when every replica refused for space
  (the old bytes remain everywhere), else with EIO, and every page of it is marked lost (EIO
  until rewritten, whether it held data or not), because it may have reached a replica whose
  answer was lost: the replicas may now disagree, and a read must never return bytes other
  than the last written. So is a write given up on the way (cancelled: the NBD connection
  went). Writes that reach no replica first wait (`unreachable_wait`) for one to come back.
- While a slab is being copied to a new replica (`repairs`), writes to it also go to the
  target, under the copy's per-slab lock, so a copied chunk never overwrites a newer write.
- The common write (one slab, every replica connected, no copy running) is one STORE per
  replica, sent at once; on the fast path (`WriteFanOut`, compiled in `duvm.store._fanout`)
  the last acknowledgement marks the pages from the receive callback. Any failure continues
  in `RemoteWrites.store_slab`, which sends it again (STORE is idempotent) and decides what it
  means; until it has, the pages read EIO (`SlabTable.mark_in_doubt`), and so they stay if the
  caller never runs the continuation it was handed (an NBD connection that went away).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c as _crc32

from duvm.base import accel
from duvm.store.counters import Counters
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.replica_errors import (
    REPLICA_FAILURES,
    UnreachableWait,
    all_parts,
    check_request,
    refused_everywhere,
    storage_error,
)
from duvm.store.replication import Replication, SlabRepair
from duvm.store.slab_table import page_crcs
from duvm.store.storage import PAGE_SIZE, Done, StorageError
from duvm.wire.pageproto import ErrorCode

_MASK = PAGE_SIZE - 1

PageCrcs = Callable[[memoryview, int], array]  # (buffer, pages) -> each page's CRC-32C


@dataclass(slots=True)
class WriteCounters(Counters):
    stores: int = 0
    pages_stored: int = 0
    write_errors: int = 0
    unreachable_waits: int = 0


class WriteFanOut:
    """The fast path of `RemoteWrites`: the common write (one slab, every replica connected,
    no repair copying it) as one STORE to each replica at once, acknowledged from the receive
    path when all stored it. Any failure continues in `RemoteWrites.store_slab`, which sends it
    again (STORE is idempotent), drops the replicas that failed and decides what it means;
    meanwhile the pages are in doubt (they read EIO), unless every replica refused the write
    for space. Compiled twin: `duvm.store._fanout` (see `fan_out_type`)."""

    __slots__ = ("page_crcs", "replication", "table", "writes")

    def __init__(self, writes: RemoteWrites) -> None:
        self.writes = writes
        self.replication = writes.replication
        self.table = writes.table
        self.page_crcs = writes.page_crcs

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        n = len(data)
        assert not (offset | n) & _MASK, f"unaligned request ({offset}, {n})"
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        if not self.replication.open:
            return False
        t = self.table
        first, count = offset >> 12, n >> 12
        slab = first // t.slab_pages
        clients = self._connected_replicas(slab, count)
        if clients is None or (first + count - 1) // t.slab_pages != slab:
            return False
        writes = self.writes
        crcs: list[array] = []  # the pages' checksums, once computed (see below)
        waiting = replicas = len(clients)
        failures: list[BaseException] = []
        token: int | None = None  # a replicated write in flight (SlabTable.write_started)

        def stored(exc: BaseException | None) -> None:
            """Called once per replica: None (stored) or the failure; the last call
            finishes the write."""
            nonlocal waiting
            if exc is not None:
                failures.append(exc)
            waiting -= 1
            if waiting:
                return
            inflight[slab] -= 1
            if token is not None:
                t.write_ended(token)
            if not failures:
                try:
                    t.mark_stored(first, count, data, crcs[0] if crcs else None)
                except Exception as e:  # never leave the request unanswered
                    done(tag, e)
                    return
                counters = writes.counters
                counters.stores += 1
                counters.pages_stored += count
                done(tag, None)
            elif all(isinstance(e, REPLICA_FAILURES) for e in failures):
                if not refused_everywhere(failures, replicas):
                    try:  # it may have reached a replica: EIO until the general path decides
                        t.mark_in_doubt(first, count)
                    except Exception as e:  # never leave the request unanswered
                        done(tag, e)
                        return
                done(tag, writes.store_slab(slab, first, count, data))
            else:
                done(tag, next(e for e in failures if not isinstance(e, REPLICA_FAILURES)))

        keys = (first,) if count == 1 else tuple(range(first, first + count))
        inflight = t.inflight
        inflight[slab] += 1  # a repair starting now waits for this write to finish
        if waiting > 1:  # registered before any STORE can leave
            token = t.write_started(first, count, data)
        for c in clients:
            if c.rdma is None:
                # by TCP (connected, as `_connected_replicas` just found, and nothing ran
                # since that could change it): `MemClient.store_cb`'s common case, straight
                # into its send queue
                c.queue.store_cb(keys, data, stored)
            elif not c.store_cb(keys, data, stored):  # not connected after all: a failure
                stored(MemserverUnreachable(f"not connected to memserver {c.peer}"))
        if count > 1:
            # Needed only at the acknowledgement, so computed once the STOREs have left (this
            # callback normally runs right after the send), while the memservers copy the
            # pages, instead of after they answered: for 512 KiB that is about 40% of the
            # daemon's work per write taken off the write's latency. Should the
            # acknowledgements come first, `mark_stored` computes them itself (D29).
            checksum = self.page_crcs
            clients[0].loop.call_soon(lambda: crcs.append(checksum(data, count)))
        return True

    def _connected_replicas(self, slab: int, count: int) -> tuple[MemClient, ...] | None:
        """The slab's replicas when one STORE of `count` pages can go straight to each (all
        connected, no repair copying the slab), else None: the general path decides."""
        clients = self.table.slab_clients[slab]
        if slab in self.replication.repairs:
            return None
        for c in clients:
            if c.hello is None or count > c.max_batch:
                return None
        return clients


def fan_out_type() -> type[WriteFanOut]:
    """The compiled `WriteFanOut` (duvm.store._fanout) when the compiled path runs here, else
    this one, the reference."""
    compiled = accel.load("duvm.store._fanout")
    return compiled.WriteFanOut if compiled is not None else WriteFanOut


class RemoteWrites:
    """The write path of a `RemoteStore` over `replication`; `fan_out` its fast path."""

    def __init__(
        self,
        replication: Replication,
        unreachable_wait: float,
        page_crcs: PageCrcs = page_crcs,
    ) -> None:
        """`page_crcs` checksums a write's pages (both paths, for writes of several pages)."""
        self.page_crcs = page_crcs
        self.replication = replication
        self.table = replication.table
        self.unreachable_wait = unreachable_wait
        self.counters = WriteCounters()
        self.fan_out = fan_out_type()(self)

    def _lone_replica(self, slab: int, count: int) -> MemClient | None:
        """The slab's only replica when one STORE of `count` pages can go straight to it (no
        replication, no repair copying the slab), else None: the general path decides."""
        clients = self.table.slab_clients[slab]
        if len(clients) != 1 or slab in self.replication.repairs or count > clients[0].max_batch:
            return None
        return clients[0]

    async def write(self, offset: int, data: memoryview) -> None:
        n = len(data)
        if (offset | n) & _MASK or not self.replication.open:
            check_request(offset, n, self.replication.open)
        t = self.table
        first, count = offset >> 12, n >> 12
        slab = first // t.slab_pages
        if (first + count - 1) // t.slab_pages == slab:  # within one slab: no splitting
            c = self._lone_replica(slab, count)
            if c is not None and c.hello is not None:
                # The common case without replication: one STORE awaited right here. On any
                # failure the general path below sends it again (STORE is idempotent) and
                # decides what the failure means (ENOSPC, EIO, pages lost).
                inflight = t.inflight
                inflight[slab] += 1  # a repair starting now waits for this write to finish
                try:
                    await c.store_batch(
                        (first,) if count == 1 else tuple(range(first, first + count)), data
                    )
                    ok = True
                except REPLICA_FAILURES:
                    ok = False
                except BaseException:  # given up (cancelled): the STORE may have landed
                    t.write_failed(first, count)
                    raise
                finally:
                    inflight[slab] -= 1
                if ok:
                    t.mark_stored(first, count, data, None)
                    counters = self.counters
                    counters.stores += 1
                    counters.pages_stored += count
                    return
            await self.store_slab(slab, first, count, data)
            return
        parts = []
        for slab, s, k in t.runs(first, count):
            a = (s - first) * PAGE_SIZE
            parts.append(self.store_slab(slab, s, k, data[a : a + k * PAGE_SIZE]))
        await all_parts(parts)

    async def store_slab(self, slab: int, first: int, count: int, data: memoryview) -> None:
        """The general path for pages within one slab: every replica, the repair target too,
        again until one stored it or none can. Given up on the way (cancelled), the write may
        have reached a replica: its pages are lost, as when it fails."""
        rep = self.replication.repairs.get(slab)
        try:
            if rep is None:
                inflight = self.table.inflight
                inflight[slab] += 1  # a repair starting now waits for this write to finish
                try:
                    await self._store_replicas(slab, first, count, data, None)
                finally:
                    inflight[slab] -= 1
            else:
                async with rep.lock:  # the copier holds it per chunk: no copy overwrites it
                    await self._store_replicas(slab, first, count, data, rep)
        except StorageError:
            raise  # failed: `_store_replicas` marked what the failure means
        except BaseException:  # given up on the way (cancelled) or a bug: it may have landed
            self.table.write_failed(first, count)
            raise

    async def _store_replicas(
        self, slab: int, first: int, count: int, data: memoryview, rep: SlabRepair | None
    ) -> None:
        self.counters.stores += 1
        self.counters.pages_stored += count
        wait = UnreachableWait(self.unreachable_wait, self.counters)
        while True:
            err = await self._store_round(slab, first, count, data, rep)
            if err is None:
                return
            # a replica may come back: wait, then try again
            unreachable = isinstance(err, MemserverUnreachable)
            if unreachable and self.replication.open and await wait.again():
                continue
            break
        self.counters.write_errors += 1
        what = f"writing pages {first}..{first + count - 1}"
        if isinstance(err, PageServerError) and err.code == ErrorCode.NO_SPACE:
            raise storage_error(err, what) from None  # refused everywhere: old bytes remain
        self.table.write_failed(first, count)  # replicas may disagree now: never serve either
        raise storage_error(err, what) from None

    async def _store_round(
        self, slab: int, first: int, count: int, data: memoryview, rep: SlabRepair | None
    ) -> Exception | None:
        """Store on every replica once. None when at least one stored it (the others are
        dropped); else the failure to act on: NO_SPACE only if every replica refused for
        space, MemserverUnreachable if any could not be reached."""
        t = self.table
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        members = list(t.sets[slab])
        clients = t.slab_clients[slab]
        if len(clients) == 1 and rep is None:
            crcs = (_crc32(data),) if count == 1 else self.page_crcs(data, count)
            try:
                await _store_one(clients[0], keys, data)
                results: list = [None]
            except REPLICA_FAILURES as e:
                results = [e]
        else:
            targets = list(clients)
            if rep is not None and not rep.aborted:
                targets.append(self.replication.clients[rep.target])
            # registered before any STORE can leave (SlabTable.write_started)
            token = t.write_started(first, count, data)
            started: list[Awaitable[Any] | None] = []
            try:
                started = [_start_store(c, keys, data) for c in targets]
                if count > 1 and any(s is not None for s in started):
                    await asyncio.sleep(0)  # the STOREs leave: checksum while they are copied
                crcs = (_crc32(data),) if count == 1 else self.page_crcs(data, count)
                results = await asyncio.gather(
                    *[_store_one(c, keys, data, s) for c, s in zip(targets, started, strict=True)],
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
            finally:
                t.write_ended(token)
            if len(results) > len(members):
                r = results.pop()
                if isinstance(r, BaseException):
                    rep.aborted = f"writing to the new replica failed: {r}"
        failed = [
            (i, r) for i, r in zip(members, results, strict=True) if isinstance(r, BaseException)
        ]
        for _, r in failed:
            if not isinstance(r, REPLICA_FAILURES):
                raise r  # a bug or cancellation, not a replica failure
        if len(failed) < len(members):  # stored by at least one replica: those are the truth
            for i, r in failed:
                self.replication.drop_replica(slab, i, f"write failed: {r}")
            t.record(first, count, crcs)
            return None
        errs = [r for _, r in failed]
        unreachable = [r for r in errs if isinstance(r, MemserverUnreachable)]
        if unreachable:
            return unreachable[0]
        nospace = [
            r for r in errs if isinstance(r, PageServerError) and r.code == ErrorCode.NO_SPACE
        ]
        return errs[0] if len(nospace) < len(errs) else nospace[0]


def _start_store(
    client: MemClient, keys: tuple[int, ...], data: memoryview
) -> Awaitable[Any] | None:
    """Queue the STORE at once when the client is connected (it leaves with this loop
    iteration's sends); None when `_store_one` has to connect first."""
    if client.hello is not None and len(keys) <= client.max_batch:
        return client.store_batch(keys, data)
    return None


async def _store_one(
    client: MemClient,
    keys: tuple[int, ...],
    data: memoryview,
    started: Awaitable[Any] | None = None,
) -> None:
    if started is None:
        started = _start_store(client, keys, data)
    if started is not None:
        try:
            await started
            return
        except MemserverUnreachable:
            pass  # store() below reconnects (if the breaker allows) and retries
    await client.store(keys, data)
