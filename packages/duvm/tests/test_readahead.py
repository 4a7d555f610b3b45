"""RemoteStore's sequential readahead over real memservers on loopback: sequential reads are
answered from windows loaded ahead, and no read ever returns bytes other than the last ones
written (writes, trims and bad copies drop the windows that hold them)."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import shutil

import pytest
from duvm.node.daemon.nbdserver import NBDServer
from duvm.store.readahead import WINDOW_PAGES
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import PAGE_SIZE as PS
from duvm.store.storage import StorageError

MiB = 1 << 20
READ = 8 * PS  # the kernel's swap-in cluster (32 KiB)


@pytest.fixture
async def written(memserver_pool):
    """`srv, store, data = await written(size)`: one memserver, a one-replica store of `size`
    bytes filled with random `data`; the stores are closed at teardown."""
    stores: list[RemoteStore] = []

    async def make(size: int) -> tuple:
        srvs, addrs = await memserver_pool(1, 2 * size)
        store = await RemoteStore.open(addrs, size, f"t:ra:{len(stores)}", replicas=1)
        stores.append(store)
        data = os.urandom(size)
        await store.write(0, memoryview(data))
        return srvs[0], store, data

    try:
        yield make
    finally:
        for store in stores:
            await store.close()


def loads(srv) -> int:
    return srv.store.counters["load_requests"]


async def test_sequential_reads_are_served_from_windows_loaded_ahead(written, fast) -> None:
    srv, store, data = await written(4 * MiB)
    before = loads(srv)
    out = bytearray(READ)
    n = (4 * MiB) // READ
    for i in range(n):
        assert await fast(store.start_read, i * READ, memoryview(out)) == "fast"
        assert out == data[i * READ : (i + 1) * READ], i
    st = store.counters()
    # two reads go to the memserver themselves; from then on windows are ahead of them
    assert st["ra_hits"] >= n - 3
    assert st["ra_loads"] >= (4 * MiB) // (WINDOW_PAGES * PS) - 2
    assert loads(srv) - before <= st["ra_loads"] + 3  # far fewer LOADs than reads
    assert st["ra_dropped"] == 0


async def test_the_next_window_is_fetched_after_the_reply_that_called_for_it(written) -> None:
    """Sending a LOAD wakes the memserver, which on a shared core then ran before the reply to
    the read that called for it: a read served from a window is answered first, and the fetch
    of the next window follows in the next loop iteration."""
    _, store, data = await written(1 * MiB)
    loop = asyncio.get_running_loop()
    out = bytearray(READ)
    hits = deferred = 0
    for i in range(MiB // READ):
        fut = loop.create_future()
        at_done: list[int] = []

        def done(tag: object, cont: object, fut=fut, at_done=at_done) -> None:
            at_done.append(store.counters()["ra_loads"])
            if type(cont) is memoryview:
                out[:] = cont
            fut.set_result(cont)

        before = store.counters()["ra_loads"]
        assert store.start_read(i * READ, memoryview(out), done, None)
        cont = await fut
        assert cont is None or type(cont) is memoryview, cont
        assert out == data[i * READ : (i + 1) * READ], i
        if type(cont) is memoryview:  # a window answered it at once
            hits += 1
            assert at_done == [before], i  # nothing was fetched before the reply
            await asyncio.sleep(0)
            deferred += store.counters()["ra_loads"] - before
        else:
            await asyncio.sleep(0)
    assert hits >= MiB // READ - 3 and deferred >= 2  # windows 3 and 4 came after replies


async def test_random_reads_fetch_nothing_ahead(written, fast) -> None:
    _, store, data = await written(4 * MiB)
    rng = random.Random(3)
    out = bytearray(PS)
    for _ in range(200):
        p = rng.randrange(1024 // 2) * 2  # never two in a row
        await fast(store.start_read, p * PS, memoryview(out))
        assert out == data[p * PS : (p + 1) * PS]
    assert store.counters()["ra_loads"] <= 3 and store.counters()["ra_hits"] <= 3


async def test_writes_and_trims_never_leave_stale_bytes_in_a_window(memserver_pool, fast) -> None:
    """A model of every page, checked on every read, while a sequential reader keeps windows
    loaded and writes (fast path and general path) and trims land inside and ahead of them.
    Whenever a window is held, the table tells the readahead of every change (`on_change`);
    with none held, it calls nothing."""
    _srvs, addrs = await memserver_pool(1, 8 * MiB)
    pages = 1024
    store = await RemoteStore.open(addrs, pages * PS, "t:ra:3", replicas=1)
    rng = random.Random(11)
    model = bytearray(os.urandom(pages * PS))
    ra = store.readahead
    try:
        await store.write(0, memoryview(bytes(model)))
        assert not ra.windows and store.table.on_change is None
        out = bytearray(READ)
        pos = 0
        unwatched = 0
        for step in range(600):
            if ra.windows:
                assert store.table.on_change == ra.invalidate, step
            unwatched += store.table.on_change is None
            op = rng.random()
            if op < 0.6:  # the sequential reader
                sp = store.table.slab_pages
                if store.table.state.count(1, pos, pos + 8) == 8 and pos // sp == (pos + 7) // sp:
                    await fast(store.start_read, pos * PS, memoryview(out))
                else:  # trimmed pages or two slabs: the fast path leaves them to the general path
                    await store.read(pos * PS, memoryview(out))
                assert out == model[pos * PS : pos * PS + READ], (step, pos)
                # now and then the kernel skips a page or three: reads then span two windows
                pos += 8 + (rng.randrange(1, 4) if rng.random() < 0.1 else 0)
                pos = 0 if pos + 8 > pages else pos
            else:  # a change just ahead of the reader, where the windows are
                p = (pos + rng.randrange(0, 2 * WINDOW_PAGES)) % pages
                n = min(rng.choice((1, 2, 8)), pages - p)
                new = os.urandom(n * PS)
                if op < 0.75:
                    await fast(store.start_write, p * PS, memoryview(new))
                elif op < 0.9:
                    await store.write(p * PS, memoryview(new))
                else:
                    await store.trim(p * PS, n * PS)
                    new = bytes(n * PS)
                    if rng.random() < 0.5:  # written again right away
                        new = os.urandom(n * PS)
                        await store.write(p * PS, memoryview(new))
                model[p * PS : (p + n) * PS] = new
        assert store.counters()["ra_hits"] > 50 and store.counters()["ra_dropped"] > 0
        assert unwatched > 0  # every window dropped at times: nothing called meanwhile
        whole = bytearray(pages * PS)
        await store.read(0, memoryview(whole))
        assert whole == model
    finally:
        await store.close()


def hold(srv) -> None:
    """Stop the memserver reading its connections: requests queue up in the sockets."""
    for conn in srv.open_connections():
        conn.transport.pause_reading()


def release(srv) -> None:
    for conn in srv.open_connections():
        conn.transport.resume_reading()


@pytest.mark.parametrize("store_first", [False, True], ids=["load-then-store", "store-then-load"])
async def test_a_write_racing_a_window_in_flight_is_never_hidden(
    memserver_pool, fast, store_first
) -> None:
    """A window whose LOAD is on the wire while a STORE to one of its pages goes out, in
    either order on the connection: reads after the write's acknowledgement see the new
    bytes, and the reads that waited for the window get bytes that were current."""
    srvs, addrs = await memserver_pool(1, 8 * MiB)
    store = await RemoteStore.open(addrs, 2 * MiB, "t:ra:4", replicas=1)
    try:
        data = bytearray(os.urandom(2 * MiB))
        await store.write(0, memoryview(bytes(data)))
        target = 2 * 8 + 3  # a page of the window fetched after reads at pages 0 and 8
        new = os.urandom(PS)
        bufs = [bytearray(READ) for _ in range(3)]
        hold(srvs[0])
        ops = []
        if store_first:
            ops.append(asyncio.ensure_future(fast(store.start_write, target * PS, memoryview(new))))
            await asyncio.sleep(0)
        ops += [
            asyncio.ensure_future(fast(store.start_read, i * READ, memoryview(bufs[i])))
            for i in range(3)
        ]  # 0 and 1 load themselves; 2 waits for the window
        await asyncio.sleep(0)
        ra = store.readahead
        assert [w.ready for w in ra.windows] == [False]  # its LOAD is queued, not answered
        assert ra.windows[0].first <= target < ra.windows[0].first + ra.windows[0].count
        if not store_first:
            ops.append(asyncio.ensure_future(fast(store.start_write, target * PS, memoryview(new))))
        await asyncio.sleep(0.05)
        assert not any(op.done() for op in ops)  # the memserver has not answered yet
        release(srvs[0])
        await asyncio.gather(*ops)
        old = bytes(data)
        data[target * PS : (target + 1) * PS] = new
        assert bufs[0] == old[:READ] and bufs[1] == old[READ : 2 * READ]
        # the waiting read ran concurrently with the write: old or new bytes, never a mix
        assert bufs[2] in (old[2 * READ : 3 * READ], bytes(data[2 * READ : 3 * READ]))
        got = bytearray(READ)
        await fast(store.start_read, 2 * READ, memoryview(got))  # after the acknowledgement
        assert got == data[2 * READ : 3 * READ]
        assert store.counters()["ra_dropped"] >= 1
    finally:
        await store.close()


async def test_a_corrupt_page_ahead_drops_the_window_and_reads_eio(written, fast) -> None:
    srv, store, data = await written(2 * MiB)
    bad = 40  # inside the first window fetched ahead
    ns = srv.store.namespaces[store.client_id]
    srv.store.arena.view(ns.pages[bad])[7] ^= 0xFF
    out = bytearray(READ)
    for i in range(bad // 8):
        await fast(store.start_read, i * READ, memoryview(out))
        assert out == data[i * READ : (i + 1) * READ]
    assert store.counters()["ra_dropped"] >= 1  # the window with the bad page was not used
    with pytest.raises(StorageError) as ei:
        await fast(store.start_read, (bad // 8) * READ, memoryview(out))
    assert ei.value.errno == errno.EIO  # never the corrupt bytes


async def test_a_real_nbd_client_reading_sequentially_gets_every_byte(
    memserver_pool, tmp_path
) -> None:
    """nbdcopy reading the export in 32 KiB requests, one at a time (as the kernel swaps in):
    the NBD server answers most of them from readahead windows, sent without a copy, and the
    copy matches what was written."""
    nbdcopy = shutil.which("nbdcopy")
    if nbdcopy is None:
        pytest.skip("nbdcopy is not installed (CI installs libnbd-bin: see .ci/run)")
    _, addrs = await memserver_pool(1, 16 * MiB)
    size = 8 * MiB
    store = await RemoteStore.open(addrs, size, "t:ra:nbd", replicas=1)
    server = NBDServer(store)
    sock = tmp_path / "nbd.sock"
    await server.start_unix(str(sock))
    try:
        data = os.urandom(size)
        await store.write(0, memoryview(data))
        dst = tmp_path / "copy.bin"
        proc = await asyncio.create_subprocess_exec(
            nbdcopy,
            "--connections=1",
            "--requests=1",
            "--request-size=32768",
            "--no-extents",
            f"nbd+unix:///?socket={sock}",
            str(dst),
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err
        assert dst.read_bytes() == data
        reads = size // (32 << 10)
        assert store.counters()["ra_hits"] >= reads * 3 // 4  # most from windows
        assert store.counters()["ra_dropped"] == 0
    finally:
        await server.close()
        await store.close()


async def test_a_read_across_two_ready_windows_is_served_from_both(written, fast) -> None:
    """The kernel skips a page it still has in its swap cache: the reader's next reads are
    shifted, and one of them spans the end of a window and the start of the next one."""
    srv, store, data = await written(4 * MiB)
    out = bytearray(READ)
    p = 0  # in pages
    for _ in range(WINDOW_PAGES // 8):  # sequential 8-page reads: two windows are loaded
        assert await fast(store.start_read, p * PS, memoryview(out)) == "fast"
        p += 8
    ws = sorted(store.readahead.windows, key=lambda w: w.first)
    assert len(ws) == 2 and ws[0].first + ws[0].count == ws[1].first
    await asyncio.sleep(0.05)  # both windows have arrived
    assert all(w.ready for w in ws)
    assert p < ws[1].first - 3  # still in the first window: skip ahead to 3 pages before the
    p = ws[1].first - 3  # second one, so the next read spans both
    hits, before = store.counters()["ra_hits"], loads(srv)
    assert await fast(store.start_read, p * PS, memoryview(out)) == "fast"
    assert out == data[p * PS : p * PS + READ]
    assert store.counters()["ra_hits"] == hits + 1 and loads(srv) == before  # no trip for it
    # a read into a window that is not loaded (yet) is not answered from half of it
    ws[1].ready = False
    q = ws[1].first - 2
    assert await fast(store.start_read, q * PS, memoryview(out)) == "fast"
    assert out == data[q * PS : q * PS + READ]
    assert store.counters()["ra_hits"] == hits + 1
