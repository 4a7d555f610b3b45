"""Trims of a `RemoteStore`: the pages read as zeros at once, and are FREEd on every replica.

A replica that cannot free is dropped from the slab (its stale pages would hold capacity);
the trim itself succeeds, since the pages read as zeros from then on. While a slab is being
copied to a new replica, the FREE also goes to the target, under the copy's lock.

A write racing the trim (same pages, both in flight) must leave them either written with its
bytes everywhere or trimmed, never marked written in the table while a memserver freed them
(a read would then meet "not found" there and take a healthy replica for a bad one). Its STORE
may reach a memserver just before the FREE, and be acknowledged before the FREE is: so while
the trim is in flight the write does not mark the pages written (`SlabTable.trim_started`,
`keep_trimmed`), and once every FREE is answered the pages are cleared again, so that a write
that failed meanwhile (pages marked lost) leaves them trimmed too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from duvm.store.counters import Counters
from duvm.store.replica_errors import REPLICA_FAILURES, check_request
from duvm.store.replication import Replication, SlabRepair
from duvm.store.storage import PAGE_SIZE


@dataclass(slots=True)
class TrimCounters(Counters):
    frees: int = 0
    pages_freed: int = 0


class RemoteTrims:
    """The trim path of a `RemoteStore` over `replication`."""

    def __init__(self, replication: Replication) -> None:
        self.replication = replication
        self.table = replication.table
        self.counters = TrimCounters()

    async def trim(self, offset: int, length: int) -> None:
        check_request(offset, length, self.replication.open)
        t = self.table
        first, count = offset // PAGE_SIZE, length // PAGE_SIZE
        slabs = t.trimmed_slabs(first, count)
        if not slabs:  # nothing on the memservers to free
            t.clear(first, count)
            return
        # reads during the FREE see zeros, as they will after; racing writes mark nothing
        token = t.trim_started(first, count)
        try:
            await asyncio.gather(*(self._free_slab(slab, keys) for slab, keys in slabs.items()))
            # A write that failed meanwhile marked the pages lost: trimmed, they read zeros.
            t.clear(first, count)
        finally:
            t.trim_ended(token)
        self.counters.pages_freed += sum(len(k) for k in slabs.values())

    async def _free_slab(self, slab: int, keys: list[int]) -> None:
        rep = self.replication.repairs.get(slab)
        if rep is not None:
            async with rep.lock:
                await self._free_replicas(slab, keys, rep)
        else:
            inflight = self.table.inflight
            inflight[slab] += 1
            try:
                await self._free_replicas(slab, keys, None)
            finally:
                inflight[slab] -= 1

    async def _free_replicas(self, slab: int, keys: list[int], rep: SlabRepair | None) -> None:
        members = list(self.table.sets[slab])
        targets = [*members, rep.target] if rep is not None and not rep.aborted else members
        res = await asyncio.gather(
            *(self.replication.clients[i].free(keys) for i in targets), return_exceptions=True
        )
        self.counters.frees += len(targets)
        for i, r in zip(targets, res, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, REPLICA_FAILURES):
                    raise r
                if rep is not None and i == rep.target:
                    rep.aborted = f"freeing on the new replica failed: {r}"
                else:
                    self.replication.drop_replica(slab, i, f"free failed: {r}")
