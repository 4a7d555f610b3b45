"""RemoteStore over real memservers on loopback: placement, zeros, trim, refusals, losses."""

from __future__ import annotations

import asyncio
import errno
import os
import random
from array import array

import pytest
from duvm.memserver.server import MemServer
from duvm.node.daemon.status import daemon_status
from duvm.store.memclient import MemClient
from duvm.store.memserver_status import query_status
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import PAGE_SIZE as PS
from duvm.store.storage import StorageError

MiB = 1 << 20


@pytest.fixture
async def servers(memserver_pool):
    return await memserver_pool(2, 8 * MiB)


async def used(addrs: list[tuple[str, int]]) -> list[int]:
    return [(await query_status(*a))["used_pages"] for a in addrs]


async def test_reserve_before_exposing_and_release_on_close(servers) -> None:
    _, addrs = servers
    store = await RemoteStore.open(addrs, 10 * MiB, "node-a:/dev/nbd0:1", slab_pages=64)
    st = await store.peer_status()
    # 40 slabs of 64 pages alternate between the two memservers: 20 slabs = 1280 pages each
    assert [s["reserved_pages"] for s in st] == [1280, 1280]
    assert store.placement[:4] == [(0,), (1,), (0,), (1,)]
    assert [s["used_pages"] for s in st] == [0, 0]
    await store.close()
    st = [await query_status(*a) for a in addrs]
    assert [s["reserved_pages"] for s in st] == [0, 0]
    assert [s["namespaces"] for s in st] == [[], []]


async def test_round_trip_across_slabs_and_memservers(servers) -> None:
    _, addrs = servers
    store = await RemoteStore.open(addrs, 8 * MiB, "n:rt:1", slab_pages=16)
    data = os.urandom(3 * MiB + 5 * PS)
    await store.write(7 * PS, memoryview(data))
    out = bytearray(len(data))
    await store.read(7 * PS, memoryview(out))
    assert out == data
    whole = bytearray(8 * MiB)
    await store.read(0, memoryview(whole))
    assert whole[: 7 * PS] == bytes(7 * PS) and whole[7 * PS : 7 * PS + len(data)] == data
    assert whole[7 * PS + len(data) :] == bytes(8 * MiB - 7 * PS - len(data))
    pages = len(data) // PS
    assert sum(await used(addrs)) == pages and min(await used(addrs)) > 0  # spread over both
    await store.close()


async def test_never_written_pages_read_as_zeros_without_a_network_trip(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, 4 * MiB, "n:zero:1", unreachable_wait=0.5)
    await store.write(PS, memoryview(b"w" * PS))
    for s in srvs:  # every memserver gone: only a local answer can succeed
        await s.close()
    out = bytearray(b"\xff" * 2 * PS)
    await store.read(2 * PS, memoryview(out))
    assert out == bytes(2 * PS)
    await store.read(0, memoryview(out[:PS]))
    assert store.counters()["loads"] == 0 and store.counters()["zero_reads"] == 2
    with pytest.raises(StorageError) as ei:  # the written page needs its memserver
        await store.read(PS, memoryview(bytearray(PS)))
    assert ei.value.errno == errno.EIO
    await store.release()


async def test_trim_and_write_zeroes_free_remote_pages(servers) -> None:
    _, addrs = servers
    store = await RemoteStore.open(addrs, 4 * MiB, "n:trim:1", slab_pages=32)
    await store.write(0, memoryview(os.urandom(2 * MiB)))
    assert sum(await used(addrs)) == 512
    await store.trim(64 * PS, 100 * PS)
    assert sum(await used(addrs)) == 412
    out = bytearray(100 * PS)
    await store.read(64 * PS, memoryview(out))
    assert out == bytes(100 * PS)
    await store.write_zeroes(0, 4 * MiB)
    assert sum(await used(addrs)) == 0
    frees = store.counters()["frees"]
    await store.trim(0, 4 * MiB)  # nothing written: no request at all
    assert store.counters()["frees"] == frees
    await store.close()


async def test_concurrent_pipelined_requests_keep_data_intact(servers) -> None:
    _, addrs = servers
    store = await RemoteStore.open(addrs, 4 * MiB, "n:conc:1", slab_pages=8)
    rnd = random.Random(7)
    model = bytearray(4 * MiB)

    # Disjoint ranges per writer, so the expected final content is well defined.
    async def disjoint_writer(i: int) -> None:
        base = i * 64
        for _ in range(40):
            page = base + rnd.randrange(60)
            n = rnd.choice([1, 2, 4])
            blob = os.urandom(n * PS)
            await store.write(page * PS, memoryview(blob))
            model[page * PS : (page + n) * PS] = blob

    await asyncio.gather(*(disjoint_writer(i) for i in range(16)))
    out = bytearray(4 * MiB)
    await asyncio.gather(
        *(
            store.read(i * 256 * PS, memoryview(out)[i * 256 * PS : (i + 1) * 256 * PS])
            for i in range(4)
        )
    )
    assert out == model
    await store.close()


async def test_pool_too_small_is_enospc_and_reserves_nothing(servers) -> None:
    _, addrs = servers
    with pytest.raises(StorageError) as ei:
        await RemoteStore.open(addrs, 17 * MiB, "n:big:1")
    assert ei.value.errno == errno.ENOSPC and "cannot hold the export" in str(ei.value)
    assert [(await query_status(*a))["reserved_pages"] for a in addrs] == [0, 0]


async def test_unreachable_peer_is_a_clear_error_and_reserves_nothing(servers) -> None:
    _, addrs = servers
    with pytest.raises(StorageError) as ei:
        await RemoteStore.open([addrs[0], ("127.0.0.1", 1)], MiB, "n:unreach:1")
    assert ei.value.errno == errno.EHOSTUNREACH and "127.0.0.1:1" in str(ei.value)
    st = await query_status(*addrs[0])
    assert (st["reserved_pages"], st["namespaces"]) == (0, [])


async def test_memserver_refusal_is_enospc_not_a_hang(servers) -> None:
    """Another client with the same id shrinks the reservation under the store's feet."""
    _, addrs = servers
    store = await RemoteStore.open(addrs[:1], MiB, "n:full:1")
    await store.write(0, memoryview(b"a" * PS))
    thief = MemClient(*addrs[0], "n:full:1")
    await thief.connect()
    await thief.reserve(1)
    with pytest.raises(StorageError) as ei:
        await asyncio.wait_for(store.write(PS, memoryview(b"b" * PS)), 5)
    assert ei.value.errno == errno.ENOSPC
    out = bytearray(2 * PS)
    await store.read(0, memoryview(out))
    assert out == b"a" * PS + bytes(PS)  # the refused write left no trace
    await thief.close()
    await store.close()


async def test_lost_namespace_reads_fail_with_eio_never_other_bytes() -> None:
    srv = MemServer(MiB, lease_s=60, lock=False)
    host, port = await srv.start()
    store = await RemoteStore.open([(host, port)], MiB, "n:lost:1")
    await store.write(0, memoryview(b"x" * PS))
    await srv.close()  # the memserver restarts empty on the same port
    srv = MemServer(MiB, lease_s=60, lock=False)
    await srv.start(host, port)
    try:
        with pytest.raises(StorageError) as ei:
            await store.read(0, memoryview(bytearray(PS)))
        assert ei.value.errno == errno.EIO and "lost" in str(ei.value)
        assert store.clients[0].namespace_losses == 1
        await store.write(PS, memoryview(b"y" * PS))  # the reservation was restored
        out = bytearray(PS)
        await store.read(PS, memoryview(out))
        assert out == b"y" * PS
    finally:
        await store.close()
        await srv.close()


async def test_dropped_connection_is_restored_transparently(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs[:1], MiB, "n:drop:1")
    await store.write(0, memoryview(b"d" * PS))
    for conn in srvs[0].open_connections():
        conn.transport.abort()  # the memserver side drops it; the lease keeps the namespace
    await asyncio.sleep(0.05)
    out = bytearray(PS)
    await store.read(0, memoryview(out))  # fast path fails, the retrying path reconnects
    assert out == b"d" * PS
    for conn in srvs[0].open_connections():
        conn.transport.abort()
    await asyncio.sleep(0.05)
    await store.write(PS, memoryview(b"e" * PS))
    await store.read(PS, memoryview(out))
    assert out == b"e" * PS
    assert store.clients[0].hello.resumed and store.clients[0].namespace_losses == 0
    await store.close()


async def test_two_replicas_hold_every_page_and_reads_fail_over(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, 2 * MiB, "n:r2:1", replicas=2, slab_pages=64)
    assert all(len(set(p)) == 2 for p in store.placement)
    data = os.urandom(MiB)
    await store.write(0, memoryview(data))
    assert await used(addrs) == [256, 256]
    await srvs[0].close()
    out = bytearray(MiB)
    await store.read(0, memoryview(out))
    assert out == data
    await store.close()


async def test_unaligned_requests_below_the_nbd_layer_are_a_bug(servers) -> None:
    """Requests are validated once, by the NBD layer (an unaligned one gets EINVAL there:
    test_nbdproto, test_nbd_clients); a store below it asserts instead of checking again."""
    _, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "n:align:1")
    out = memoryview(bytearray(PS))
    for coro in (
        store.read(1, out),
        store.write(0, memoryview(b"x" * 512)),
        store.trim(PS, 100),
    ):
        with pytest.raises(AssertionError, match="unaligned"):
            await coro
    with pytest.raises(AssertionError, match="unaligned"):
        store.start_read(1, out, lambda tag, cont: None, "t")
    await store.close()


def test_constructor_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        RemoteStore([("h", 1)], 1000, "x")
    with pytest.raises(ValueError, match="at least one"):
        RemoteStore([], PS, "x")
    with pytest.raises(ValueError, match="replicas"):
        RemoteStore([("h", 1)], PS, "x", replicas=2)
    with pytest.raises(ValueError, match="twice"):
        RemoteStore([("h", 1), ("h", 1)], PS, "x")


def test_page_crcs_are_each_pages_crc32c() -> None:
    from crc32c import crc32c
    from duvm.store.slab_table import page_crcs
    from duvm.wire.pageproto import MAX_BATCH

    for count in (1, 2, 64, MAX_BATCH, MAX_BATCH + 3):  # the last one past the slice table
        buf = memoryview(os.urandom(count * PS))
        got = page_crcs(buf, count)
        assert list(got) == [crc32c(buf[k * PS : (k + 1) * PS]) for k in range(count)]
    buf = memoryview(bytearray(8 * PS))
    assert list(page_crcs(buf, 3)) == [crc32c(bytes(PS))] * 3  # only the first pages


@pytest.mark.parametrize("path", ["reference", "compiled"])
async def test_a_fast_write_checksums_its_pages_while_the_memserver_stores_them(
    servers, fast, pick_path, path: str
) -> None:
    """Catches a fast write (reference `WriteFanOut` or its compiled twin) that checksums its
    pages only after the memserver answered (on the write's latency), checksums them twice
    (again at the acknowledgement), or records checksums that do not vouch for the bytes."""
    from crc32c import crc32c
    from duvm.store.slab_table import page_crcs

    pick_path(path, "duvm.store._fanout")
    srvs, addrs = servers
    seen: list[tuple[int, int]] = []  # (STOREs the memserver had handled, pages) at each call

    def spy(buf: memoryview, count: int) -> array:
        seen.append((srvs[0].store.counters["store_requests"], count))
        return page_crcs(buf, count)

    store = await RemoteStore.open(addrs[:1], MiB, "t:crc-overlap", replicas=1, write_crcs=spy)
    try:
        # the fast path of the asked-for kind runs here
        module = "remote_write" if path == "reference" else "_fanout"
        assert type(store.writes.fan_out).__module__ == f"duvm.store.{module}"
        data = os.urandom(64 * PS)
        before = srvs[0].store.counters["store_requests"]
        assert await fast(store.start_write, 8 * PS, memoryview(data)) == "fast"
        # computed once, before the memserver had even handled the STORE (in flight), and
        # not again at the acknowledgement
        assert seen == [(before, 64)]
        assert srvs[0].store.counters["store_requests"] == before + 1
        assert list(store.table.crc[8:72]) == [
            crc32c(data[k * PS : (k + 1) * PS]) for k in range(64)
        ]
        out = bytearray(64 * PS)
        await store.read(8 * PS, memoryview(out))  # the checksums vouch for the bytes
        assert out == data and store.counters()["checksum_failures"] == 0
    finally:
        await store.close()


async def test_a_replicated_write_checksums_its_pages_after_its_stores_left(servers) -> None:
    """Catches the general (coroutine) write path checksumming its pages before its STOREs
    left (the checksums then delay every replica's copy) or more than once."""
    from duvm.store.slab_table import page_crcs

    srvs, addrs = servers
    # when the checksums were taken: STOREs each memserver had handled, and whether every
    # client had sent what it had queued
    seen: list[tuple[list[int], bool]] = []

    def spy(buf: memoryview, count: int) -> array:
        sent = all(c.queue.idle for c in store.clients)
        seen.append(([s.store.counters["store_requests"] for s in srvs], sent))
        return page_crcs(buf, count)

    store = await RemoteStore.open(
        addrs, MiB, "t:crc-overlap-2", replicas=2, slab_pages=64, write_crcs=spy
    )
    try:
        data = os.urandom(32 * PS)
        before = [s.store.counters["store_requests"] for s in srvs]
        await store.write(0, memoryview(data))  # two replicas: the general (coroutine) path
        assert seen == [(before, True)]  # once, with both STOREs sent and not yet handled
        after = [s.store.counters["store_requests"] for s in srvs]
        assert sorted(a - b for a, b in zip(after, before, strict=True))[-2:] == [1, 1]
        assert store.table.pending_writes == {}  # nothing left registered for racing reads
        out = bytearray(32 * PS)
        await store.read(0, memoryview(out))
        assert out == data and store.counters()["checksum_failures"] == 0
    finally:
        await store.close()


async def test_a_replicated_write_registers_its_bytes_before_any_store_leaves(servers) -> None:
    """A racing read may get the write's new bytes from one replica as soon as a STORE has
    left, even before the writer runs again: the bytes are registered before that, and a
    write closed midway (as an aborted NBD connection closes it) leaves nothing behind."""
    _srvs, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:pending", replicas=2, slab_pages=64)
    try:
        await store.write(0, memoryview(os.urandom(8 * PS)))  # the pages hold data
        data = os.urandom(8 * PS)
        coro = store.write(0, memoryview(data))
        assert coro.send(None) is None  # driven by hand, as nbdconnection does: the first yield
        [(first, count, held)] = store.table.pending_writes.values()
        assert (first, count) == (0, 8) and bytes(held) == data
        bad = bytearray(data[:PS])
        bad[9] ^= 1  # not the write's bytes: still bad
        assert store.table.bad_pages(0, 1, memoryview(data[:PS])) == []  # the write's: not bad
        assert store.table.bad_pages(0, 1, memoryview(bad)) == [0]
        coro.close()
        assert store.table.pending_writes == {} and store.table.inflight[0] == 0
    finally:
        await store.close()


async def test_one_batching_object_per_store_shared_down_the_stack(servers) -> None:
    """Catches batching kept in module state (one store's cork would hold another store's
    requests) or a filter that hides its inner store's batching (the NBD server would cork
    an object no connection looks at, and every request would cost an extra loop
    iteration)."""
    from duvm.store.crypt_store import CryptStore
    from duvm.store.storage import FaultStore

    _, addrs = servers
    a = await RemoteStore.open(addrs, 4 * MiB, "n:batch-a:1", slab_pages=16)
    b = await RemoteStore.open(addrs, 4 * MiB, "n:batch-b:1", slab_pages=16)
    try:
        assert a.batching is not b.batching
        assert all(c.batching is a.batching for c in a.clients)
        assert FaultStore(CryptStore(a)).batching is a.batching
        # corked, a write's requests are held by its store's connections, not sent...
        assert a.batching.cork() and not a.batching.cork()  # nested: only the outer uncorks
        page = memoryview(os.urandom(PS))
        wrote = asyncio.ensure_future(a.write(0, page))
        other = asyncio.ensure_future(b.write(0, page))
        await asyncio.wait_for(other, 5)  # ...while another store's are not held at all
        await asyncio.sleep(0.05)
        assert not wrote.done()
        a.batching.uncork()  # ...and leave when uncorked
        await asyncio.wait_for(wrote, 5)
        out = memoryview(bytearray(PS))
        await a.read(0, out)
        assert out == page
    finally:
        await a.close()
        await b.close()


async def test_each_stacking_takes_the_path_it_declares(servers) -> None:
    """Catches a filter over a RemoteStore that hides its fast path: FaultStore and CryptStore
    (also stacked) must forward it, and the callback path then serves the request, opened
    in place when the pages are sealed."""
    from duvm.store.crypt_store import CryptStore
    from duvm.store.storage import FaultStore

    _, addrs = servers
    remote = await RemoteStore.open(addrs, 4 * MiB, "n:stack:1", slab_pages=16)
    try:
        page = memoryview(os.urandom(PS))
        await remote.write(0, page)
        sealed = CryptStore(remote)
        await sealed.write(PS, page)  # page 1: ciphertext below, the plain page above
        stacks = {
            "remote": remote,
            "fault over remote": FaultStore(remote),
            "crypt over remote": sealed,
            "crypt over fault over remote": CryptStore(FaultStore(remote)),
        }
        declared = {name: s.fast_path for name, s in stacks.items()}
        assert declared == {
            "remote": True,
            "fault over remote": True,
            "crypt over remote": True,
            "crypt over fault over remote": True,
        }
        # what the NBD server offers a declared fast path: a forwarding filter takes it
        done = asyncio.get_running_loop().create_future()
        out = memoryview(bytearray(PS))

        def finished(tag: object, cont: object) -> None:
            done.set_result(cont)

        assert stacks["fault over remote"].start_read(0, out, finished, "t") is True
        cont = await asyncio.wait_for(done, 5)
        if asyncio.iscoroutine(cont):  # the store handed the rest to a coroutine
            await cont
        elif isinstance(cont, memoryview):
            out[:] = cont
        assert bytes(out) == bytes(page)
        # the encrypting filter forwards too, and opens what the store below loaded
        done = asyncio.get_running_loop().create_future()
        out[:] = bytes(PS)
        assert sealed.start_read(PS, out, finished, "t") is True
        assert await asyncio.wait_for(done, 5) is None
        assert bytes(out) == bytes(page) and sealed.counters()["pages_opened"] == 1
        below = bytearray(PS)
        await remote.read(PS, memoryview(below))
        assert bytes(below) != bytes(page)  # the store below holds only ciphertext
        # a page never written through the filter has nothing to load: declined (zeros)
        assert sealed.start_read(2 * PS, out, finished, "t") is False
        # every stack reports the health of the store it wraps, per-peer pages included
        # (two written pages, on the one replica of slab 0); counters are apart from it, each
        # stack's its own layers' beside the store's
        want = remote.health()
        assert sum(peer["pages"] for peer in want["peers"]) == 2
        assert "pages_stored" not in want and "repair" not in want
        for s in stacks.values():
            assert s.health() == want
            assert s.counters().items() >= remote.counters().items()
        assert sealed.counters()["pages_sealed"] == 1  # the filter's own, beside the store's
        assert "pages_sealed" not in remote.counters()
        # what `duvm status` reads: health and every layer's counters, flat, once
        shown = daemon_status(sealed, None, 1).to_json()["store"]
        assert shown == {**want, **sealed.counters()} and shown["pages_sealed"] == 1
        assert all(
            s.describe() == f"2 memserver(s){extra}"
            for s, extra in (
                (stacks["remote"], ""),
                (stacks["fault over remote"], ", faults injected"),
                (stacks["crypt over remote"], ", pages encrypted"),
            )
        )
    finally:
        await remote.close()
