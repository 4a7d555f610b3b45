"""Three safety rules of the store and the memserver, each guarded by a fast test over real
memservers on loopback (no root, no swap): a never-written page read into a reused buffer is
zeros, a write to any page of a readahead window drops it, and a lease never frees the pages of
a client that came back."""

from __future__ import annotations

import asyncio
import os
import time

from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memserver_status import query_status
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import PAGE_SIZE as PS

MiB = 1 << 20
READ = 8 * PS  # the kernel's swap-in cluster (32 KiB)


async def test_a_never_written_page_read_into_a_reused_buffer_is_zeros(memserver_pool) -> None:
    """Catches: the single-page read of a never-written (EMPTY) page skipping the zeroing in
    `RemoteReads.read`, so whatever an earlier request left in the reused buffer (here: another
    page's bytes, then garbage) would reach the kernel as the page's contents."""
    _srvs, addrs = await memserver_pool(1, 8 * MiB)
    store = await RemoteStore.open(addrs, 1 * MiB, "t:safety:zero", replicas=1)
    try:
        written = os.urandom(PS)
        await store.write(3 * PS, memoryview(written))
        buf = bytearray(PS)  # one buffer for every request, as the NBD server reuses its own
        view = memoryview(buf)
        await store.read(3 * PS, view)  # an earlier request leaves real bytes in it
        assert buf == written
        for garbage in (written, b"\xa5" * PS):
            buf[:] = garbage
            loads, zero_reads = store.counters()["loads"], store.counters()["zero_reads"]
            # the callback fast path declines a never-written page: the general path answers
            assert not store.start_read(7 * PS, view, lambda tag, cont: None, None)
            await store.read(7 * PS, view)  # exactly one page: the single-page branch
            assert buf == bytes(PS)
            # zeros made locally, no LOAD sent
            assert store.counters()["zero_reads"] == zero_reads + 1
            assert store.counters()["loads"] == loads
    finally:
        await store.close()


async def test_a_write_to_any_page_of_a_readahead_window_drops_it(memserver_pool, fast) -> None:
    """Catches: `Readahead.invalidate` dropping a window only when the write touches the
    window's first page, so a later read of another page of that window would be answered from
    the window with the bytes from before the acknowledged write."""
    _srvs, addrs = await memserver_pool(1, 8 * MiB)
    store = await RemoteStore.open(addrs, 1 * MiB, "t:safety:ra", replicas=1)
    try:
        data = os.urandom(1 * MiB)
        await store.write(0, memoryview(data))
        out = bytearray(READ)
        # reads at pages 0 and 8 go to the memserver and fetch the window at page 16; the read
        # at 16 is answered from that window, so it has arrived and is ready
        for i in range(3):
            assert await fast(store.start_read, i * READ, memoryview(out)) == "fast"
            assert out == data[i * READ : (i + 1) * READ]
        ra = store.readahead
        assert store.counters()["ra_hits"] == 1
        (w,) = [w for w in ra.windows if w.first == 16]
        assert w.ready and w.count > 24
        target = w.first + 20  # inside the window, far from its first page
        dropped = store.counters()["ra_dropped"]

        new = os.urandom(PS)
        await store.write(target * PS, memoryview(new))
        page = bytearray(PS)
        assert await fast(store.start_read, target * PS, memoryview(page)) == "fast"
        assert page == new, "the read was answered with the bytes from before the write"
        # because the window holding the old bytes was dropped by the write (and counted)
        assert w not in ra.windows
        assert not any(x.first <= target < x.first + x.count for x in ra.windows)
        assert store.counters()["ra_dropped"] == dropped + 1
        # the neighbours still read as written, the old bytes nowhere
        assert await fast(store.start_read, (target + 1) * PS, memoryview(page)) == "fast"
        assert page == data[(target + 1) * PS : (target + 2) * PS]
    finally:
        await store.close()


LEASE_S = 1.0


async def test_lease_expiry_never_frees_the_pages_of_a_client_that_reconnected() -> None:
    """Catches two bugs, each alone: (b) `PageStore.attach` not cancelling the lease timer of a
    namespace its client reconnects to, so that timer still fires at the original deadline and,
    the client having disconnected again meanwhile (its new lease running), frees its pages
    early; (a) `PageStore._expire` ignoring live connections, so a lease timer that fires
    anyway frees the pages of a client that is connected (here it is fired the way the timer
    would; attach cancelling the timer is what normally keeps it from firing)."""
    srv = MemServer(1 * MiB, lease_s=LEASE_S, lock=False)
    addr = await srv.start()
    cid = "node-a/nbd0/lease"
    pages = {2: os.urandom(PS), 5: os.urandom(PS)}
    try:
        c = MemClient(*addr, cid)
        await c.connect()
        await c.reserve(8)
        for k, b in pages.items():
            await c.store([k], b)
        await c.close()
        await asyncio.sleep(0.05)  # the server sees the disconnect: the lease starts
        ps = srv.store
        ns = ps.namespaces[cid]
        first_deadline, first_timer = ns.expires_at, ns.timer
        assert first_deadline is not None and first_timer is not None

        hello = await c.connect()  # back within the lease
        assert (hello.resumed, hello.stored_pages) == (True, 2)
        assert ns.timer is None and ns.expires_at is None

        # connected for most of the first lease, then gone again: a new lease starts now
        await asyncio.sleep(max(0.0, first_deadline - 0.3 - time.monotonic()))
        await c.close()
        await asyncio.sleep(max(0.0, first_deadline + 0.1 - time.monotonic()))
        # past the first deadline, inside the second lease: nothing may have been freed
        st = await query_status(*addr)
        rows = st["namespaces"]
        assert [r["client_id"] for r in rows] == [cid], "the namespace was freed by a lease"
        row = rows[0]
        assert (row["stored_pages"], row["connections"]) == (2, 0)
        assert row["lease_expires_in"] > 0 and st["used_pages"] == 2
        # because the first lease's timer was cancelled when the client came back
        assert first_timer.cancelled()

        hello = await c.connect()
        assert (hello.resumed, hello.reserved_pages, hello.stored_pages) == (True, 8, 2)
        for k, b in pages.items():
            assert await c.load([k]) == b

        # a lease timer that fires while the client is connected frees nothing
        ps._expire(ns)
        for k, b in pages.items():
            assert await c.load([k]) == b
        # because the expiry saw the live connection and left the namespace alone
        assert ps.namespaces.get(cid) is ns and ns.connections == 1
        assert (len(ns.pages), ns.reserved, ps.arena.used_slots) == (2, 8, 2)
        await c.close()
    finally:
        await srv.close()
