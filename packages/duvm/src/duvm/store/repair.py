"""Background re-replication: bring degraded slabs back to R copies.

Theory of operation: `Repairer.run` is one task per `RemoteStore`, acting on its `Replication`.
It sleeps until a replica is dropped (`wake`) or a retry period passes, then walks the degraded
slabs one at a time:

1. Pick a target: a peer not already holding the slab, reachable (its breaker lets a probe
   through and HELLO succeeds), with room: what we reserved there and have not assigned, plus
   what the memserver has unreserved (STATUS), chosen by power of two choices. If our own
   reservation there is short, RESERVE more first (absolute, so a retry is harmless); a refusal
   excludes the peer for this round. No target: wait and retry later (a pool with no room
   stays degraded and says so; it never over-commits a memserver).
2. Register the copy in `Replication.repairs`: from now on writes and trims to the slab also go to
   the target, under the slab's lock.
3. FREE the slab's keys on the target (it may hold stale copies from before it was dropped),
   then copy the slab in chunks: under the lock, LOAD the chunk's written pages from a good
   replica (checksums verified, `load_verified`) and STORE them to the target. Holding the lock
   per chunk means no write to the slab interleaves with a chunk copy, so the target never
   ends up with older bytes than the replicas.
4. If the target failed meanwhile (`aborted`), give up this attempt (the slab stays degraded,
   the target is avoided for a while); otherwise add it to the slab's replica set.

A replica dropped from a slab while its memserver lives on (a failed write, an aborted stall)
keeps its pages there, inside our reservation, so its room stays counted as assigned
(`Replication.stale`) until each pass first FREEs such copies on the peers it can reach; only
then is that room spare for a copy. A copy that fails leaves its partial pages stale the same way.

A slab whose every replica has been unreachable for longer than the memservers' namespace lease
has lost its pages for certain (the lease has freed them even if the peer returns): its written
pages are marked lost (EIO until rewritten, never other bytes) and it is placed on a new peer,
so the kernel's writes to those slots work again. Before the lease runs out, the slab waits:
a peer that comes back in time still holds the pages. Such slabs are handled first in each
pass, so a degraded slab that finds no target cannot keep them failing.

Copying is paced by the memservers' answers, one chunk at a time, and yields to the event loop
between chunks, so repair traffic does not starve the kernel's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from duvm.store.counters import Counters
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.placement import choose
from duvm.store.replication import Replication, SlabRepair
from duvm.store.storage import DATA, PAGE_SIZE, StorageError

# the read path's verified load (RemoteReads.load_verified): slab, first page, pages, into
LoadVerified = Callable[[int, int, int, memoryview], Coroutine[Any, Any, None]]

log = logging.getLogger(__name__)

CHUNK_PAGES = 64  # pages copied per lock hold: short enough that writes barely wait
RETRY_S = 1.0  # how often degraded slabs without a target are looked at again
AVOID_S = 5.0  # a target that failed a copy is not chosen again for this long
GRACE_S = 1.0  # beyond a memserver's lease before its pages are taken as gone


@dataclass(slots=True)
class RepairCounters(Counters):
    repairs_done: int = 0
    repair_failures: int = 0
    repair_pages_copied: int = 0
    no_target: int = 0
    slabs_replaced: int = 0
    stale_freed: int = 0


class Repairer:
    """Restores `replication.want` copies of every slab; copies through `load_verified`."""

    def __init__(self, replication: Replication, load_verified: LoadVerified) -> None:
        self.replication = replication
        self._load_verified = load_verified
        self._wake = asyncio.Event()
        self._avoid: dict[int, float] = {}  # peer -> monotonic time it may be chosen again
        self.counters = RepairCounters()
        self.last_error: str | None = None
        # one copy buffer for the repairer's lifetime (slabs are copied one at a time): a
        # repair under memory pressure allocates nothing per slab
        self._buf = memoryview(bytearray(CHUNK_PAGES * PAGE_SIZE))

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancel that
            # arrives as the event is set, and close() then waited for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(RETRY_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.repair_all()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let the task die: log, count, try again later
                self.counters.repair_failures += 1
                self.last_error = str(e)
                log.exception("repair pass failed")

    async def repair_all(self) -> int:
        """One pass over the degraded slabs; returns how many were repaired."""
        s = self.replication
        done = 0
        await self.free_stale()
        now = time.monotonic()
        # Slabs whose every replica is gone first: they fail every request until replaced,
        # and a degraded slab with no target below must not keep them waiting.
        for slab in range(s.table.nslabs):
            if slab in s.repairs or not self._gone(s.table.sets[slab], now):
                continue
            target = await self._pick_target(slab)
            if target is None:
                self.counters.no_target += 1
                break
            self._charge(target, slab)
            s.replace_lost_slab(slab, target)
            self.counters.slabs_replaced += 1
        for slab in range(s.table.nslabs):
            if slab in s.repairs or self._gone(s.table.sets[slab], now):
                continue
            if len(s.table.sets[slab]) >= s.want:
                continue
            target = await self._pick_target(slab)
            if target is None:
                self.counters.no_target += 1
                return done
            if await self.copy_slab(slab, target):
                done += 1
        return done

    def _charge(self, target: int, slab: int) -> None:
        """Count the slab's room on `target` as assigned (a stale copy there already is)."""
        s = self.replication
        if (target, slab) in s.stale:
            s.stale.discard((target, slab))
        else:
            s.assigned[target] += s.table.slab_size(slab)

    async def free_stale(self) -> None:
        """FREE the pages of dropped copies on reachable peers, so their reservation is
        spare room again (until then it stays counted in `assigned`)."""
        s = self.replication
        for peer, slab in sorted(s.stale):
            c = s.clients[peer]
            if not c.connected or slab in s.repairs or peer in s.table.sets[slab]:
                continue
            first = slab * s.table.slab_pages
            try:
                await c.free(range(first, first + s.table.slab_size(slab)))
            except (PageServerError, MemserverUnreachable) as e:
                log.info(
                    "repair: cannot free slab %d's dropped copy on %s yet: %s", slab, c.peer, e
                )
                continue
            if (peer, slab) in s.stale and peer not in s.table.sets[slab]:  # (still) stale: room
                s.stale.discard((peer, slab))
                s.assigned[peer] -= s.table.slab_size(slab)
                self.counters.stale_freed += 1

    def _gone(self, members: list[int], now: float) -> bool:
        """Every replica has been unreachable for longer than its memserver's lease: even if
        it comes back, it will have dropped our pages."""
        for i in members:
            c = self.replication.clients[i]
            if c.connected or c.down_since is None or c.lease_s is None:
                return False
            if now - c.down_since < c.lease_s + GRACE_S:
                return False
        return True

    async def _pick_target(self, slab: int) -> int | None:
        s = self.replication
        need = s.table.slab_size(slab)
        now = time.monotonic()
        exclude = set(s.table.sets[slab]) | {i for i, t in self._avoid.items() if t > now}
        candidates = [i for i in range(len(s.clients)) if i not in exclude]
        if not candidates:
            return None
        probes = await asyncio.gather(*(s.clients[i].probe() for i in candidates))
        live = [i for i, ok in zip(candidates, probes, strict=True) if ok]
        statuses = await asyncio.gather(
            *(s.clients[i].status() for i in live), return_exceptions=True
        )
        room = [-1] * len(s.clients)
        for i, st in zip(live, statuses, strict=True):
            if isinstance(st, dict):
                room[i] = s.reserved[i] - s.assigned[i] + int(st.get("unreserved_pages", 0))
        tried: set[int] = set(exclude)
        while True:
            i = choose(room, need, tried, s.rng)
            if i is None:
                return None
            tried.add(i)
            spare = s.reserved[i] - s.assigned[i]
            if spare >= need:
                return i
            try:
                await s.clients[i].reserve(s.reserved[i] + need - spare)
            except (PageServerError, MemserverUnreachable) as e:
                log.info(
                    "repair: %s cannot reserve %d more pages: %s",
                    s.clients[i].peer,
                    need - spare,
                    e,
                )
                continue
            s.reserved[i] += need - spare
            return i

    async def copy_slab(self, slab: int, target: int) -> bool:
        """Copy the slab's written pages to `target` and make it a replica. True on success."""
        s = self.replication
        n = s.table.slab_size(slab)
        first = slab * s.table.slab_pages
        state = s.table.state
        rep = SlabRepair(target, state.count(DATA, first, first + n))
        s.repairs[slab] = rep
        self._charge(target, slab)
        client = s.clients[target]
        buf = self._buf  # copy_slab runs one at a time (repair_all awaits each)
        t0 = time.monotonic()
        try:
            # Writes that started before the copy was registered do not go to the target:
            # let them finish before reading anything (new ones take the lock path).
            while s.table.inflight[slab]:
                await asyncio.sleep(0.001)
            await client.free(range(first, first + n))  # stale copies from an earlier life
            for c0 in range(first, first + n, CHUNK_PAGES):
                c1 = min(c0 + CHUNK_PAGES, first + n)
                async with rep.lock:
                    if rep.aborted:
                        break
                    p = c0
                    while p < c1:
                        q = state.find(DATA, p, c1)
                        if q < 0:
                            break
                        r = next((x for x in range(q, c1) if state[x] != DATA), c1)
                        out = buf[: (r - q) * PAGE_SIZE]
                        try:
                            await self._load_verified(slab, q, r - q, out)
                        except StorageError as e:
                            if e.errno != errno.EIO or state.count(DATA, q, r):
                                raise  # a good replica is out of reach: try again later
                            p = r  # those pages were lost everywhere: nothing to copy
                            continue
                        await client.store(range(q, r), out)
                        rep.copied += r - q
                        self.counters.repair_pages_copied += r - q
                        p = r
                await asyncio.sleep(0)  # let the kernel's requests in between chunks
            if rep.aborted:
                raise StorageError(errno.EIO, rep.aborted)
            if not s.table.sets[slab]:
                raise StorageError(errno.EIO, "the slab has no replica left to copy from")
            s.add_replica(slab, target)
        except (StorageError, PageServerError, MemserverUnreachable) as e:
            s.stale.add((target, slab))  # what was copied fills room there until freed
            self._avoid[target] = time.monotonic() + AVOID_S
            self.counters.repair_failures += 1
            self.last_error = f"slab {slab} to {client.peer}: {e}"
            s.events.event(
                ("repair failed", target),
                logging.WARNING,
                "repair of slab %d to %s failed: %s",
                slab,
                client.peer,
                e,
            )
            return False
        finally:
            del s.repairs[slab]
        self.counters.repairs_done += 1
        log.info(
            "slab %d repaired onto %s (%d pages in %.2f s); %d of %d replicas",
            slab,
            client.peer,
            rep.copied,
            time.monotonic() - t0,
            len(s.table.sets[slab]),
            s.want,
        )
        return True
