"""Repair's room accounting after a replica is dropped from a live memserver.

A replica dropped while its memserver still runs (a write to it failed, a stall was aborted)
keeps its pages there, in our namespace and inside our reservation, until they are freed. The
repairer must not take that reservation for spare room before it has freed them: a copy onto
that memserver is then refused (NO_SPACE, "exceeds the reservation") and the slab stays
degraded, retried and refused again. Real in-process memservers on loopback, a real
`RemoteStore` and `Repairer`.
"""

from __future__ import annotations

import os

from duvm.store.remote_store import RemoteStore
from duvm.store.repair import Repairer
from duvm.store.storage import PAGE_SIZE

SLAB = 64  # pages per slab
SLABS = 6


async def _namespace_pages(store: RemoteStore, peer: int) -> int:
    st = await store.clients[peer].status()
    return next(ns["stored_pages"] for ns in st["namespaces"] if ns["client_id"] == store.client_id)


async def test_repair_onto_a_peer_holding_a_dropped_copy_frees_that_copy_first(
    memserver_pool,
) -> None:
    servers, addrs = await memserver_pool(3, 4 << 20)
    store = await RemoteStore.open(
        addrs,
        SLABS * SLAB * PAGE_SIZE,
        "repair-accounting",
        slab_pages=SLAB,
        replicas=2,
        repair=False,
        seed=3,
    )
    try:
        data = os.urandom(SLABS * SLAB * PAGE_SIZE)
        await store.write(0, memoryview(data))
        # s2 on {a, c}; s1, after s2 (repairs go in slab order), holds b, the third peer
        pl = store.placement
        s2 = next(
            x for x in range(SLABS) if any(set(pl[y]) - set(pl[x]) for y in range(x + 1, SLABS))
        )
        a, c = pl[s2]
        b = ({0, 1, 2} - {a, c}).pop()
        s1 = next(y for y in range(s2 + 1, SLABS) if b in pl[y])
        before = await _namespace_pages(store, b)
        assert before == sum(SLAB for m in store.placement if b in m)  # b's pages fill it
        assert before == store.replication.reserved[b]  # exactly: no spare room there

        assert store.replication.drop_replica(s1, b, "test: a write to it failed")
        assert await _namespace_pages(store, b) == before  # the dropped copy is still there
        await servers[c].close()  # c dies: s2 needs a new replica, and only b can take it
        assert store.replication.drop_replica(s2, c, "test: its memserver died")

        rep = Repairer(store.replication, store.reads.load_verified)
        assert await rep.repair_all() == 2  # s2 onto b, then s1 back onto b (c is dead)
        assert rep.counters.repair_failures == 0, rep.last_error
        assert b in store.table.sets[s2] and b in store.table.sets[s1]
        # mechanism: the dropped copy of s1 was freed on b before s2 was copied there
        assert rep.counters.stale_freed == 1 and not store.replication.stale - {(c, s2)}
        held = sum(store.table.slab_size(s) for s, m in enumerate(store.table.sets) if b in m)
        assert (
            await _namespace_pages(store, b)
            == held
            == store.replication.assigned[b]
            == before + SLAB
        )
        # outcome: s2 reads back intact from b alone
        assert store.replication.drop_replica(s2, a, "test: read from the repaired copy")
        out = bytearray(SLAB * PAGE_SIZE)
        await store.read(s2 * SLAB * PAGE_SIZE, memoryview(out))
        assert out == data[s2 * SLAB * PAGE_SIZE : (s2 + 1) * SLAB * PAGE_SIZE]
    finally:
        await store.close()
