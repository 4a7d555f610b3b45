"""`Replication`: which memservers hold each slab's copies, the room they hold for us, and the
copies being repaired; the one owner of that state for a `RemoteStore`.

- The live replica set of each slab is in the `SlabTable` (`sets`, `slab_clients`); every
  change to it goes through here: `drop_replica` (a copy failed), `add_replica` (a repair
  finished), `replace_lost_slab` (every copy is gone for good), `namespace_lost` (a memserver
  came back without our pages).
- Room: the pages we `reserved` on each peer, the pages of slabs `assigned` there (placed or
  being copied), and `stale` copies a dropped replica may still hold, which stay counted as
  assigned until the repairer frees them.
- `repairs`: the slab copies in progress (`repair.SlabRepair`); writes and trims to such a
  slab also go to the copy's target, under its lock.
- `open`: the export is placed and reserved, so requests may be served.

The read, write and trim paths, the health watchdog and the repairer all act through this
object; none of them keeps a copy of this state.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from duvm.base.quietlog import QuietLog
from duvm.store.counters import Counters
from duvm.store.memclient import MemClient
from duvm.store.slab_table import SlabTable

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


class SlabRepair:
    """A copy of one slab to a new replica in progress: writes to the slab take `lock` while
    it runs and also go to `target`; `aborted` says why it must not become a replica."""

    __slots__ = ("aborted", "copied", "lock", "target", "total")

    def __init__(self, target: int, total: int) -> None:
        self.target = target
        self.lock = asyncio.Lock()
        self.total = total
        self.copied = 0
        self.aborted: str | None = None


@dataclass(slots=True)
class ReplicationCounters(Counters):
    replicas_dropped: int = 0


class Replication:
    """The replica sets of `table`'s slabs over `clients`, `want` copies of each."""

    def __init__(
        self, table: SlabTable, clients: Sequence[MemClient], want: int, rng: random.Random
    ) -> None:
        self.table = table
        self.clients = list(clients)
        self.want = want
        self.rng = rng
        self.index = {c: i for i, c in enumerate(self.clients)}
        self.open = False
        self.repairs: dict[int, SlabRepair] = {}  # slab -> copy in progress
        self.reserved = [0] * len(self.clients)  # pages we reserved on each peer
        self.assigned = [0] * len(self.clients)  # pages of slabs placed (or copying) there
        # (peer, slab): a dropped copy that may still hold pages there (counted in assigned)
        self.stale: set[tuple[int, int]] = set()
        self.events = QuietLog(log)  # failover messages: one line per kind, then counts
        self.counters = ReplicationCounters()
        self.on_dropped: Callable[[], None] = _nothing  # the repairer's wake-up

    def begin(self, placement: list[list[int]], want: list[int]) -> None:
        """The slabs are placed as `placement` and `want` pages reserved on each peer. A table
        already assigned (a standby's, `SlabTable.assign` ahead of its takeover) changes only
        the slabs whose set differs: the takeover allocates nothing per slab."""
        self.reserved = list(want)
        self.assigned = list(want)
        t = self.table
        if len(t.sets) == len(placement):
            for slab, members in enumerate(placement):
                if t.sets[slab] != members:
                    t.set_replicas(slab, list(members))
        else:
            t.assign(placement)
        self.open = True

    def degraded_slabs(self) -> list[int]:
        """Slabs with fewer live replicas than wanted."""
        return self.table.degraded_slabs(self.want)

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
        self.counters.replicas_dropped += 1
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
            self.want,
        )
        self.on_dropped()
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

    def namespace_lost(self, client: MemClient) -> None:
        """A memserver came back without our namespace: its copies are gone."""
        peer = self.index[client]
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
