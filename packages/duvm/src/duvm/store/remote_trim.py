"""Trims of a `RemoteStore`: the pages read as zeros at once, and are FREEd on every replica.

A replica that cannot free is dropped from the slab (its stale pages would hold capacity);
the trim itself succeeds, since the pages read as zeros from then on. While a slab is being
copied to a new replica, the FREE also goes to the target, under the copy's lock.
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
        t.clear(first, count)  # reads during the FREE see zeros, as they will after
        if not slabs:
            return
        await asyncio.gather(*(self._free_slab(slab, keys) for slab, keys in slabs.items()))
        # A STORE sent before this FREE on the same connection was acknowledged before it;
        # clear again so such a write's mark does not outlive the page it refers to.
        t.clear(first, count)
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
