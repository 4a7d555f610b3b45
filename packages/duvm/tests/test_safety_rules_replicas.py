"""Safety rules of the replicated store when a write fails after it reached a replica, when a
trim races a write, and when a memserver lost our namespace behind our back: each guarded by a
fast test over real memservers on loopback (no root, no swap), on the compiled path and on the
pure-Python reference (`pick_path`).

Replicas fail through a relay in front of a real memserver (`Cut`: a request that reaches the
memserver but whose answer never comes back, or one that never arrives), a memserver that
stops reading (its connections paused, so requests wait in order) or drops our connection, or
one restarted on its port (our namespace gone); pages a memserver lost are FREEd by a second
real client of the namespace. No function is patched. Each test asserts the outcome (the bytes
read, or EIO), the mechanism (page states, replica sets, counters) and clean side effects
(what each memserver holds).
"""

from __future__ import annotations

import asyncio
import errno
import os
import time

import pytest
from duvm.memserver.server import MemServer
from duvm.store import daemon_state as ds
from duvm.store.memclient import MemClient
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import DATA, EMPTY, LOST, StorageError
from duvm.store.storage import PAGE_SIZE as PS
from memserver_relay import Relay

MiB = 1 << 20
PATHS = pytest.mark.parametrize("path", ["compiled", "reference"])


async def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def held(srv: MemServer, cid: str, key: int) -> bytes | None:
    """Page `key` of namespace `cid` as the memserver holds it (None: not stored)."""
    ns = srv.store.namespaces.get(cid)
    if ns is None or key not in ns.pages:
        return None
    return bytes(srv.store.arena.view(ns.pages[key]))


def held_run(srv: MemServer, cid: str, first: int, count: int) -> bytes:
    return b"".join(held(srv, cid, k) or b"-" for k in range(first, first + count))


def pause(srvs: list[MemServer]) -> None:
    """The memservers read nothing more: what is sent to them waits, in order, in the socket."""
    for s in srvs:
        for conn in s.open_connections():
            conn.transport.pause_reading()


def resume(srvs: list[MemServer]) -> None:
    for s in srvs:
        for conn in s.open_connections():
            conn.transport.resume_reading()


class Cut(Relay):
    """A relay whose `mode` says what happens to the client's next request: "pass" forwards
    everything; "land" forwards it to the memserver, then cuts the connection as the answer
    comes back, unforwarded (the request was carried out, the client never hears); "drop"
    cuts the connection without forwarding it (never carried out). Outside "pass", a new
    connection is cut at once."""

    mode = "pass"

    def admit(self) -> bool:
        return self.mode == "pass"

    async def up(self, c_r: asyncio.StreamReader, s_w: asyncio.StreamWriter) -> None:
        while data := await c_r.read(1 << 16):
            if self.mode == "drop":
                return
            s_w.write(data)

    async def down(self, s_r: asyncio.StreamReader, c_w: asyncio.StreamWriter) -> None:
        while data := await s_r.read(1 << 16):
            if self.mode == "land":
                return
            c_w.write(data)


@pytest.fixture
async def relayed(memserver_pool):
    """Two memservers, each behind a `Cut` relay: (servers, relays, the relays' addresses)."""
    srvs, addrs = await memserver_pool(2, 8 * MiB)
    relays = [Cut(a) for a in addrs]
    fronts = [await r.start() for r in relays]
    try:
        yield srvs, relays, fronts
    finally:
        for r in relays:
            await r.close()


async def reachable_again(store: RemoteStore, relays: list[Cut]) -> None:
    """Every relay passes again and every memory client is connected through it."""
    for r in relays:
        r.mode = "pass"
    await wait_for(lambda: not any(c.circuit_open for c in store.clients))
    for c in store.clients:
        assert await c.probe()


async def read_fails(store: RemoteStore, offset: int, n: int) -> bytes:
    """Read `n` bytes at `offset`, which must fail with EIO; returns what the buffer held."""
    out = bytearray(b"\xee" * n)
    with pytest.raises(StorageError) as ei:
        await store.read(offset, memoryview(out))
    assert ei.value.errno == errno.EIO
    return bytes(out)


# --- 4: a write that failed on every replica -------------------------------------------------


@PATHS
@pytest.mark.parametrize("entry", ["fast", "coroutine"])
async def test_a_write_that_failed_on_every_replica_reads_eio_never_the_old_bytes(
    relayed, fast, pick_path, path: str, entry: str
) -> None:
    """Catches: `RemoteWrites._store_replicas` not marking the pages of a write that failed on
    every replica lost (its `self.table.write_failed(first, count)` line gone). The write
    reached one replica (which stored the new bytes; its answer was cut) and never the other
    (old bytes). Reads would then return the old bytes from the second replica, its checksum
    dropping the first as corrupt, instead of EIO; and a page never written before would read
    as zeros."""
    pick_path(path, "duvm.store._fanout")
    srvs, relays, fronts = relayed
    cid = f"t:4:{path}:{entry}"
    store = await RemoteStore.open(
        fronts, MiB, cid, replicas=2, slab_pages=64, unreachable_wait=0.3, repair=False
    )
    try:
        old, new, fresh = os.urandom(4 * PS), os.urandom(8 * PS), os.urandom(PS)
        await store.write(8 * PS, memoryview(old))  # pages 8..11 written, 12..15 never
        first, second = store.table.sets[0]
        relays[first].mode, relays[second].mode = "land", "drop"
        with pytest.raises(StorageError) as ei:
            if entry == "fast":
                await fast(store.start_write, 8 * PS, memoryview(new))
            else:
                await store.write(8 * PS, memoryview(new))
        assert ei.value.errno == errno.EIO
        # the replicas disagree: one holds the new bytes, the other the old (and nothing more)
        assert held_run(srvs[first], cid, 8, 8) == new
        assert held_run(srvs[second], cid, 8, 8) == old + b"-" * 4
        await reachable_again(store, relays)
        # outcome: each page of the failed write reads EIO, alone or in a longer read, through
        # either entry; never its old bytes, nor zeros
        for off, n in ((8 * PS, 8 * PS), (9 * PS, PS), (13 * PS, PS), (6 * PS, 4 * PS)):
            got = await read_fails(store, off, n)
            assert got == b"\xee" * n
        # the callback fast path declines them (the general path answers, above)
        assert not store.start_read(10 * PS, memoryview(bytearray(PS)), lambda t, c: None, None)
        # mechanism: every page of it is marked lost and counted; neither replica was judged
        # corrupt, nor dropped
        assert bytes(store.table.state[8:16]) == bytes((LOST,)) * 8
        c = store.counters()
        assert c["pages_lost"] == 8 and c["write_errors"] == 1
        assert c["checksum_failures"] == 0 and c["replicas_dropped"] == 0
        assert store.table.sets[0] == [first, second]
        # rewritten, the pages are whole again, on both replicas
        await store.write(8 * PS, memoryview(fresh * 8))
        out = bytearray(8 * PS)
        await store.read(8 * PS, memoryview(out))
        assert out == fresh * 8
        for s in (first, second):
            assert held_run(srvs[s], cid, 8, 8) == fresh * 8
        assert bytes(store.table.state[7:17]) == bytes([EMPTY, *[DATA] * 8, EMPTY])
    finally:
        await store.close()


@PATHS
async def test_a_fast_write_whose_continuation_never_runs_reads_eio(
    relayed, pick_path, path: str
) -> None:
    """Catches: the write fan-out (reference `WriteFanOut`, compiled `_fanout`) handing a
    write that failed on a replica to the general path without marking its pages in doubt
    first (`t.mark_in_doubt(first, count)` gone). The NBD server closes that continuation
    unstarted when its connection went away meanwhile; one replica had stored the new bytes,
    the other not, and reads would return the old bytes, dropping the replica that holds the
    new ones as corrupt."""
    pick_path(path, "duvm.store._fanout")
    srvs, relays, fronts = relayed
    cid = f"t:4b:{path}"
    store = await RemoteStore.open(
        fronts, MiB, cid, replicas=2, slab_pages=64, unreachable_wait=0.3, repair=False
    )
    try:
        old, new = os.urandom(4 * PS), os.urandom(4 * PS)
        await store.write(8 * PS, memoryview(old))
        first, second = store.table.sets[0]
        relays[second].mode = "drop"
        answered: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(tag: object, cont: object) -> None:
            assert asyncio.iscoroutine(cont), cont  # continues in the general path...
            cont.close()  # ...which never runs: the NBD connection was aborted
            answered.set_result(tag)

        assert store.start_write(8 * PS, memoryview(new), done, "w")
        assert await answered == "w"
        assert held_run(srvs[first], cid, 8, 4) == new
        assert held_run(srvs[second], cid, 8, 4) == old
        await reachable_again(store, relays)
        # outcome: EIO, never the old bytes
        assert await read_fails(store, 8 * PS, 4 * PS) == b"\xee" * (4 * PS)
        assert await read_fails(store, 11 * PS, PS) == b"\xee" * PS
        # mechanism: in doubt (lost, uncounted: the write was not known to fail), no replica
        # judged corrupt or dropped, nothing else touched
        assert bytes(store.table.state[7:13]) == bytes([EMPTY, *[LOST] * 4, EMPTY])
        c = store.counters()
        assert c["checksum_failures"] == 0 and c["replicas_dropped"] == 0
        assert c["pages_lost"] == 0 and c["write_errors"] == 0
        assert store.table.sets[0] == [first, second] and not store.table.pending_writes
        assert list(store.table.inflight) == [0] * store.table.nslabs
        await store.write(8 * PS, memoryview(new))
        out = bytearray(4 * PS)
        await store.read(8 * PS, memoryview(out))
        assert out == new and held_run(srvs[second], cid, 8, 4) == new
    finally:
        await store.close()


@PATHS
async def test_a_write_cancelled_after_it_reached_a_replica_reads_eio(
    relayed, pick_path, path: str
) -> None:
    """Catches: `RemoteWrites.store_slab` not marking the pages of a write cancelled on its
    way lost (its `except BaseException` branch's `self.table.write_failed(first, count)` line
    gone). The NBD server cancels it when its connection is aborted; here it is cancelled while
    it waits for replicas that did not answer, one of which had stored the new bytes. Reads
    would return the old bytes from the other, dropping the first as corrupt."""
    pick_path(path, "duvm.store._fanout")
    srvs, relays, fronts = relayed
    cid = f"t:4c:{path}"
    store = await RemoteStore.open(
        fronts, MiB, cid, replicas=2, slab_pages=64, unreachable_wait=30, repair=False
    )
    try:
        old, new = os.urandom(4 * PS), os.urandom(4 * PS)
        await store.write(8 * PS, memoryview(old))
        first, second = store.table.sets[0]
        relays[first].mode, relays[second].mode = "land", "drop"
        write = asyncio.ensure_future(store.write(8 * PS, memoryview(new)))
        await wait_for(lambda: store.counters()["unreachable_waits"] > 0)  # no replica answered
        write.cancel()
        with pytest.raises(asyncio.CancelledError):
            await write
        assert held_run(srvs[first], cid, 8, 4) == new
        assert held_run(srvs[second], cid, 8, 4) == old
        await reachable_again(store, relays)
        assert await read_fails(store, 8 * PS, 4 * PS) == b"\xee" * (4 * PS)
        assert await read_fails(store, 9 * PS, PS) == b"\xee" * PS
        assert bytes(store.table.state[8:12]) == bytes((LOST,)) * 4
        c = store.counters()
        assert c["pages_lost"] == 4
        assert c["checksum_failures"] == 0 and c["replicas_dropped"] == 0
        assert list(store.table.inflight) == [0] * store.table.nslabs
        assert not store.table.pending_writes
    finally:
        await store.close()


# --- 5: a write overlapping a trim of the same page ------------------------------------------


@PATHS
@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_write_racing_a_trim_never_marks_the_page_written_where_it_was_freed(
    memserver_pool, pick_path, path: str, replicas: int
) -> None:
    """Catches: a write acknowledged while a trim of its page is in flight marking the page
    written (`keep_trimmed` in `duvm.store.slab_table`, which both twins' `mark_stored` call,
    doing nothing). Each memserver of the page's slab stores the write, then frees the page for
    the trim, whose FREE on another slab is still unanswered; a read at the write's
    acknowledgement would find the page written in the table and freed on every replica:
    NOT_FOUND, a healthy replica dropped (R=2), the page marked lost and the read failed with
    EIO."""
    pick_path(path, "duvm.store._fanout")
    srvs, addrs = await memserver_pool(replicas + 1, 8 * MiB)
    cid = f"t:5:{path}:{replicas}"
    store = await RemoteStore.open(
        addrs, MiB, cid, replicas=replicas, slab_pages=64, repair=False, seed=1
    )
    try:
        near = store.table.sets[0]  # page 5's replicas
        far = [i for i in range(len(srvs)) if i not in near]  # hold the trim's other FREE
        slab = next(s for s in range(1, store.table.nslabs) if set(store.table.sets[s]) & {*far})
        p, q = 5, slab * 64 + 1  # the trim runs from page p, on `near`, to page q, also on `far`
        old, new = os.urandom(PS), os.urandom(PS)
        await store.write(p * PS, memoryview(old))
        await store.write(q * PS, memoryview(old))
        sets = [list(s) for s in store.table.sets]
        loop = asyncio.get_running_loop()
        wrote, read = loop.create_future(), loop.create_future()
        out = bytearray(b"\xee" * PS)

        def finish(coro: object) -> None:  # as the NBD server runs a store coroutine
            t = asyncio.ensure_future(coro)  # type: ignore[arg-type]
            t.add_done_callback(lambda t: read.set_result(t.exception()))

        def read_done(tag: object, cont: object) -> None:
            if asyncio.iscoroutine(cont):  # continued in the general path
                finish(cont)
            else:
                read.set_result(cont)

        def write_done(tag: object, cont: object) -> None:
            wrote.set_result((cont, store.table.state[p]))
            # a read right at the write's acknowledgement, the trim still in flight
            if not store.start_read(p * PS, memoryview(out), read_done, "r"):
                finish(store.read(p * PS, memoryview(out)))

        pause(srvs)
        assert store.start_write(p * PS, memoryview(new), write_done, "w")
        trim = asyncio.ensure_future(store.trim(p * PS, (q - p + 1) * PS))
        # page p's memservers have the write's STORE, then the trim's FREE, waiting in order
        sent = [(i in near) * 2 + (i in store.table.sets[slab]) for i in range(len(srvs))]
        await wait_for(lambda: [len(c.pending) for c in store.clients] == sent)
        resume([srvs[i] for i in near])
        # the write is acknowledged while the trim waits for `far`; so is the read
        assert await wrote == (None, EMPTY)  # the page reads as trimmed: not written
        assert await read is None
        assert bytes(out) == bytes(PS)
        assert not trim.done() and store.table.trims
        resume(srvs)
        await trim
        # mechanism: nothing judged missing, dropped or lost; the pages read as trimmed
        c = store.counters()
        assert c["replicas_dropped"] == 0 and c["pages_lost"] == 0
        assert c["checksum_failures"] == 0 and c["read_errors"] == 0
        assert [list(s) for s in store.table.sets] == sets
        assert store.table.state[p] == EMPTY and store.table.state[q] == EMPTY
        assert not store.table.trims
        # side effects: freed on every memserver, as the table says; reads are zeros
        assert all(held(s, cid, k) is None for s in srvs for k in (p, q))
        await store.read(p * PS, memoryview(out))
        assert bytes(out) == bytes(PS)
    finally:
        resume(srvs)
        await store.close()


@PATHS
async def test_a_write_that_failed_during_a_trim_leaves_the_page_trimmed(
    memserver_pool, pick_path, path: str
) -> None:
    """Catches: `RemoteTrims.trim` without its second clear (the `t.clear(first, count)` after
    the FREEs). A write to the page failed on one replica while the trim was in flight (its
    pages marked in doubt, its continuation never run); the trim then freed the page on every
    memserver, yet it would stay marked lost: reads EIO instead of the zeros of a trim that
    came last."""
    pick_path(path, "duvm.store._fanout")
    srvs, addrs = await memserver_pool(2, 8 * MiB)
    cid = f"t:5b:{path}"
    store = await RemoteStore.open(addrs, MiB, cid, replicas=2, slab_pages=64, repair=False)
    try:
        old, new = os.urandom(PS), os.urandom(PS)
        await store.write(5 * PS, memoryview(old))
        first, second = store.table.sets[0]
        answered: asyncio.Future = asyncio.get_running_loop().create_future()

        def done(tag: object, cont: object) -> None:
            assert asyncio.iscoroutine(cont), cont
            cont.close()  # the NBD connection went: the general path never runs
            answered.set_result(store.table.state[5])

        pause(srvs)
        assert store.start_write(5 * PS, memoryview(new), done, "w")
        trim = asyncio.ensure_future(store.trim(5 * PS, PS))
        await wait_for(lambda: all(len(c.pending) == 2 for c in store.clients))
        # the second memserver drops our connection with both requests unread: the write fails
        # there; the trim's FREE is sent again on the new connection
        for conn in srvs[second].open_connections():
            conn.transport.abort()
        resume(srvs)
        assert await answered == LOST  # in doubt, while the trim was in flight
        await trim
        # outcome: the trim came last: zeros
        out = bytearray(b"\xee" * PS)
        await store.read(5 * PS, memoryview(out))
        assert bytes(out) == bytes(PS)
        # mechanism and side effects: trimmed in the table, freed on both memservers, no
        # replica dropped, nothing counted lost
        assert store.table.state[5] == EMPTY and not store.table.trims
        assert held(srvs[first], cid, 5) is None and held(srvs[second], cid, 5) is None
        c = store.counters()
        assert c["replicas_dropped"] == 0 and c["pages_lost"] == 0
        assert store.table.sets[0] == [first, second]
    finally:
        resume(srvs)
        await store.close()


# --- 7: a memserver that lost our namespace ----------------------------------------------------


async def killed(store: RemoteStore, state: ds.Persisted) -> None:
    """The daemon dies (SIGKILL): nothing is released, its connections just close, and its
    page tables stay in their file for the next daemon."""
    tasks = [*store._tasks, *store.monitor.probes]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in store.clients:
        await c.close()
    state.tables.close()


@PATHS
async def test_a_resumed_namespace_lost_later_is_dropped_from_its_slabs_at_once(
    memserver_pool, tmp_path, pick_path, path: str
) -> None:
    """Catches: `MemClient.connect` not taking a resumed namespace's reservation as ours when
    this client reserved none (the `self._reserved = reply.reserved_pages` line gone). A
    restarted daemon resumes its namespaces (`RemoteStore.reattach`); its RESERVE is refused
    on a memserver that still holds a dropped replica's stale pages (more than the slab map
    places there). When that memserver later restarts, the reconnect would not see the loss:
    no slab drops it and nothing repairs until a read meets NOT_FOUND, and no reservation is
    restored there."""
    pick_path(path, "duvm.store._fanout")
    srvs, addrs = await memserver_pool(2, 8 * MiB)
    relays = [Cut(a) for a in addrs]
    fronts = [await r.start() for r in relays]
    cid, sdir = f"t:7:{path}", tmp_path / "state"
    opts = {"encrypt": False, "repair": False}
    try:
        store, state = await ds.open_store(sdir, fronts, 2 * MiB, cid, 2, resume=False, **opts)
        data = bytearray(os.urandom(2 * MiB))  # two slabs of 256 pages, on both memservers
        await store.write(0, memoryview(data))
        victim, other = store.table.sets[0]
        # a write fails on the victim: it is dropped from slab 0, its copy stays there (stale)
        relays[victim].mode = "drop"
        data[:PS] = os.urandom(PS)
        await store.write(0, memoryview(data[:PS]))
        assert store.table.sets[0] == [other] and sorted(store.table.sets[1]) == [0, 1]
        await asyncio.sleep(0)  # the slab map is saved
        await killed(store, state)
        relays[victim].mode = "pass"

        store, state = await ds.open_store(sdir, fronts, 2 * MiB, cid, 2, resume=True, **opts)
        try:
            c = store.clients[victim]
            assert c.hello.resumed and c.hello.stored_pages == 512
            # its RESERVE of slab 1's 256 pages was refused: it stores 512 (FREE them first)
            assert srvs[victim].store.namespaces[cid].reserved == 512
            # the victim's memserver restarts: our namespace there is gone
            host, port = addrs[victim]
            await srvs[victim].close()
            srvs[victim] = MemServer(8 * MiB, lease_s=60, lock=False)
            await srvs[victim].start(host, port)
            await wait_for(lambda: not c.connected)
            assert await c.probe()  # the reconnect (the watchdog's probe, or any request)
            # mechanism: the reconnect saw the loss: the victim is dropped from slab 1 at once
            # (the repairer's work), and the reservation is restored there
            assert c.namespace_losses == 1
            assert store.table.sets == [[other], [other]]
            assert store.degraded_slabs() == [0, 1]
            assert srvs[victim].store.namespaces[cid].reserved == 512
            assert store.counters()["replicas_dropped"] == 1
            # outcome: every page reads as written, from the other replica; nothing was judged
            # missing or corrupt, nothing lost
            out = bytearray(2 * MiB)
            await store.read(0, memoryview(out))
            assert out == data
            cs = store.counters()
            assert cs["failovers"] == 0 and cs["checksum_failures"] == 0
            assert cs["pages_lost"] == 0 and cs["read_errors"] == 0
            # a write goes to the slab's live replica only, and reads back
            await store.write(300 * PS, memoryview(data[:PS]))
            assert held(srvs[victim], cid, 300) is None
            assert held(srvs[other], cid, 300) == data[:PS]
        finally:
            await store.close()
            state.discard()
    finally:
        for r in relays:
            await r.close()


@PATHS
@pytest.mark.parametrize("replicas", [1, 2])
async def test_a_multi_page_not_found_loses_only_pages_not_rewritten_since(
    memserver_pool, fast, pick_path, path: str, replicas: int
) -> None:
    """Catches: `RemoteReads._load_round` taking a NOT_FOUND for a LOAD of several pages as
    every page missing (`_missing_pages` in remote_read answering all of them without loading
    each). The memservers lost pages 0..7 behind our back (freed by another client of the
    namespace, as a namespace lost unnoticed would be); page 2 was written again since and is
    there. A read of 0..7 must mark lost only the pages that are missing: page 2, an
    acknowledged write, would otherwise read EIO from then on."""
    pick_path(path, "duvm.store._readpath")
    srvs, addrs = await memserver_pool(replicas, 8 * MiB)
    cid = f"t:7b:{path}:{replicas}"
    store = await RemoteStore.open(
        addrs, MiB, cid, replicas=replicas, slab_pages=64, unreachable_wait=0.3, repair=False
    )
    try:
        old, new = os.urandom(8 * PS), os.urandom(PS)
        await store.write(0, memoryview(old))
        for a in addrs:  # the pages are lost behind the store's back
            side = MemClient(*a, cid, token=store.clients[0].token)
            await side.connect()
            await side.free(range(8))
            await side.close()
        await store.write(2 * PS, memoryview(new))
        # outcome: the read of all eight fails; page 2 reads as written, the others EIO
        out = bytearray(8 * PS)
        with pytest.raises(StorageError) as ei:
            await fast(store.start_read, 0, memoryview(out))
        assert ei.value.errno == errno.EIO
        page = bytearray(PS)
        await store.read(2 * PS, memoryview(page))
        assert page == new
        assert await fast(store.start_read, 2 * PS, memoryview(page)) == "fast"
        assert page == new
        assert await read_fails(store, 3 * PS, PS) == b"\xee" * PS
        # mechanism: exactly the missing pages are lost; the replica that lacked them first
        # is dropped (with R=2), the last one stays
        assert bytes(store.table.state[:9]) == bytes([LOST, LOST, DATA, *[LOST] * 5, EMPTY])
        c = store.counters()
        assert c["pages_lost"] == 7 and c["checksum_failures"] == 0
        assert c["replicas_dropped"] == replicas - 1 and len(store.table.sets[0]) == 1
        # side effects: page 2 is still where it was written
        (live,) = store.table.sets[0]
        assert held(srvs[live], cid, 2) == new
        assert [held(srvs[live], cid, k) for k in (0, 1, 3)] == [None] * 3
    finally:
        await store.close()
