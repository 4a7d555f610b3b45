"""Replication, checksums, failover, repair and the circuit breaker, over real memservers on
loopback (in this process, or as child processes where a peer must freeze or die), through
both the coroutine path and the callback fast path the NBD server takes."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable
from duvm.store.memserver_status import query_status
from duvm.store.placement import choose, normalize_peers, place
from duvm.store.remote_store import RemoteStore
from duvm.store.storage import PAGE_SIZE as PS
from duvm.store.storage import StorageError

MiB = 1 << 20


@pytest.fixture
async def servers(memserver_pool):
    return await memserver_pool(3, 4 * MiB)


async def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def corrupt(srv: MemServer, client_id: str, key: int) -> None:
    """Flip one byte of a stored page in the memserver's arena (a bit rot stand-in)."""
    slot = srv.store.namespaces[client_id].pages[key]
    view = srv.store.arena.view(slot)
    view[100] ^= 0xFF


async def stored_keys(srv: MemServer, client_id: str) -> set[int]:
    ns = srv.store.namespaces.get(client_id)
    return set(ns.pages) if ns else set()


# --- placement ---------------------------------------------------------------------------


def test_placement_never_puts_two_replicas_on_one_peer_and_balances() -> None:
    rng = random.Random(1)
    sizes = [256] * 60
    pl = place(sizes, [10_000, 10_000, 10_000, 10_000], 2, rng)
    assert all(len(set(p)) == 2 for p in pl)
    counts = [sum(i in p for p in pl) for i in range(4)]
    assert sum(counts) == 120 and max(counts) - min(counts) <= 12  # two choices balance


def test_placement_refuses_when_replicas_cannot_be_on_distinct_peers() -> None:
    # Room for two copies in total, but only on one peer: refusing beats doubling up.
    with pytest.raises(StorageError) as ei:
        place([256], [512, 0], 2, random.Random(0))
    assert ei.value.errno == errno.ENOSPC and "at most one per memserver" in str(ei.value)


def test_choose_prefers_more_room_and_respects_exclusion() -> None:
    rng = random.Random(0)
    assert choose([5, 100], 10, set(), rng) == 1  # peer 0 lacks room
    assert choose([50, 100], 10, {1}, rng) == 0
    assert choose([50, 100], 10, set(), rng) == 1  # of the two choices, the emptier
    assert choose([5, 5], 10, set(), rng) is None


def test_peers_are_deduplicated_by_address() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        normalize_peers([("127.0.0.1", 7070), ("localhost", 7070)])
    assert normalize_peers([("127.0.0.1", 1), ("127.0.0.1", 2)]) == [
        ("127.0.0.1", 1),
        ("127.0.0.1", 2),
    ]


# --- checksums ---------------------------------------------------------------------------


async def test_corrupt_replica_is_detected_bypassed_and_repaired(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:crc:1", replicas=2, slab_pages=64, seed=3)
    try:
        data = os.urandom(MiB)
        await store.write(0, memoryview(data))
        first = store.table.sets[0][0]
        corrupt(srvs[first], "t:crc:1", 5)
        for i in store.table.sets[0]:
            corrupt(srvs[i], "t:crc:1", 9)  # page 9 rots on every replica
        one = bytearray(PS)
        await store.read(5 * PS, memoryview(one))  # the single-page path checks too
        assert one == data[5 * PS : 6 * PS]  # served by the other replica
        assert store.counters()["checksum_failures"] == 1
        out = bytearray(MiB)
        with pytest.raises(StorageError, match="lost by every replica"):
            await store.read(0, memoryview(out))  # no good copy left of page 9: EIO
        await store.write(9 * PS, memoryview(data[9 * PS : 10 * PS]))
        await store.read(0, memoryview(out))
        assert out == data
        assert store.counters()["replicas_dropped"] >= 1  # the bad copy was no longer trusted ...
        await wait_for(lambda: len(store.table.sets[0]) == 2)  # ... and repair restored R=2
        assert store.repairer.counters.repairs_done >= 1
        new = store.table.sets[0][-1]
        assert await stored_keys(srvs[new], "t:crc:1") >= set(range(64))
        await store.read(0, memoryview(out))
        assert out == data
    finally:
        await store.close()


async def test_corruption_with_one_replica_is_eio_never_other_bytes(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs[:1], MiB, "t:crc1:1", replicas=1)
    try:
        await store.write(0, memoryview(b"q" * 2 * PS))
        corrupt(srvs[0], "t:crc1:1", 1)
        out = bytearray(2 * PS)
        with pytest.raises(StorageError) as ei:
            await store.read(0, memoryview(out))
        assert ei.value.errno == errno.EIO and "lost by every replica" in str(ei.value)
        await store.read(0, memoryview(out)[:PS])  # the intact page still reads
        assert out[:PS] == b"q" * PS
        with pytest.raises(StorageError):  # and the bad one stays an error ...
            await store.read(PS, memoryview(out)[PS:])
        await store.write(PS, memoryview(b"r" * PS))  # ... until it is written again
        await store.read(PS, memoryview(out)[PS:])
        assert out[PS:] == b"r" * PS
    finally:
        await store.close()


# --- failover and repair -----------------------------------------------------------------


async def test_memserver_death_during_io_loses_nothing_and_repair_restores_r(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, 2 * MiB, "t:die:1", replicas=2, slab_pages=32, seed=5)
    model: dict[int, bytes] = {}
    rng = random.Random(7)
    try:

        async def writer(n: int) -> None:
            for _ in range(n):
                p = rng.randrange(store.pages)
                b = os.urandom(PS)
                await store.write(p * PS, memoryview(b))
                model[p] = b

        await writer(200)
        victim = store.table.sets[0][0]
        task = asyncio.ensure_future(writer(400))
        await asyncio.sleep(0)
        await srvs[victim].close()  # dies with requests in flight
        await task
        assert all(victim not in s for s in store.table.sets)
        assert store.counters()["replicas_dropped"] > 0
        await wait_for(lambda: store.health()["degraded_slabs"] == 0, 20)
        assert all(len(set(s)) == 2 for s in store.table.sets)
        out = bytearray(PS)
        for p, b in model.items():
            await store.read(p * PS, memoryview(out))
            assert out == b, p
        assert store.health()["pages_lost_now"] == 0
    finally:
        await store.close()


async def test_degraded_without_spare_peer_keeps_serving_and_reports_it(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs[:2], MiB, "t:nospare:1", replicas=2, slab_pages=64)
    try:
        data = os.urandom(MiB)
        await store.write(0, memoryview(data))
        await srvs[1].close()
        await store.write(0, memoryview(data[::-1]))  # writes continue on the survivor
        h = store.health()
        assert h["degraded_slabs"] == store.table.nslabs
        assert store.counters()["replicas_dropped"] == store.table.nslabs
        assert h["peers"][1]["connected"] is False
        out = bytearray(MiB)
        await store.read(0, memoryview(out))
        assert out == data[::-1]
        await asyncio.sleep(1.5)  # a repair pass finds no target and says so
        assert store.counters()["no_target"] >= 1
    finally:
        await store.close()


async def test_restarted_memserver_is_dropped_and_refilled_from_its_replica(servers) -> None:
    srvs, addrs = servers
    cid = "t:restart:1"
    store = await RemoteStore.open(addrs[:2], MiB, cid, replicas=2, slab_pages=64)
    try:
        data = os.urandom(MiB)
        await store.write(0, memoryview(data))
        host, port = addrs[1]
        await srvs[1].close()
        srvs[1] = MemServer(4 * MiB, lease_s=60, lock=False)
        await srvs[1].start(host, port)  # back, empty: our namespace is gone
        await store.write(0, memoryview(data[:PS]))  # reconnect notices the loss
        await wait_for(lambda: store.health()["degraded_slabs"] == 0, 20)
        assert store.clients[1].namespace_losses == 1
        assert await stored_keys(srvs[1], cid) == set(range(256))  # copied back
        await srvs[0].close()  # now the other one dies: the refilled copy serves
        out = bytearray(MiB)
        await store.read(0, memoryview(out))
        assert out == data
    finally:
        await store.close()


async def test_r1_restart_is_an_io_error_and_the_slab_is_usable_again() -> None:
    srv = MemServer(MiB, lease_s=60, lock=False)
    host, port = await srv.start()
    store = await RemoteStore.open([(host, port)], MiB, "t:r1:1")
    try:
        await store.write(0, memoryview(b"x" * PS))
        await srv.close()
        srv = MemServer(MiB, lease_s=60, lock=False)
        await srv.start(host, port)
        with pytest.raises(StorageError) as ei:
            await store.read(0, memoryview(bytearray(PS)))
        assert ei.value.errno == errno.EIO and "lost" in str(ei.value)
        assert store.health()["pages_lost_now"] == 1
        await store.write(PS, memoryview(b"y" * PS))
        out = bytearray(PS)
        await store.read(PS, memoryview(out))
        assert out == b"y" * PS
    finally:
        await store.close()
        await srv.close()


async def test_trim_during_and_after_failover_frees_survivors(servers) -> None:
    srvs, addrs = servers
    cid = "t:trim:1"
    store = await RemoteStore.open(addrs[:2], MiB, cid, replicas=2, slab_pages=64, repair=False)
    try:
        await store.write(0, memoryview(os.urandom(MiB)))
        await srvs[0].close()
        await store.trim(0, MiB // 2)
        assert await stored_keys(srvs[1], cid) == set(range(128, 256))
        out = bytearray(PS)
        await store.read(0, memoryview(out))
        assert out == bytes(PS)
    finally:
        await store.close()


# --- circuit breaker and stalls ----------------------------------------------------------


async def test_breaker_fails_fast_while_open_and_recovers() -> None:
    srv = MemServer(MiB, lease_s=60, lock=False)
    host, port = await srv.start()
    c = MemClient(host, port, "t:breaker:1", connect_timeout=1.0)
    await c.connect()
    await c.reserve(4)
    await srv.close()
    with pytest.raises(MemserverUnreachable):
        await c.store([0], b"a" * PS)
    assert c.circuit_open and c.failures >= 1
    failures = c.failures
    with pytest.raises(MemserverUnreachable, match="next try"):
        await c.store([0], b"a" * PS)
    assert c.failures == failures  # no connect attempted while open (a failed one counts)
    srv = MemServer(MiB, lease_s=60, lock=False)
    await srv.start(host, port)
    await wait_for(lambda: not c.circuit_open, 5)
    assert await c.probe() and c.failures == 0
    await c.store([0], b"b" * PS)
    await c.close()
    await srv.close()


def _spawn_memserver() -> tuple[subprocess.Popen, tuple[str, int]]:
    code = (
        "import asyncio,sys\nfrom duvm.memserver.server import MemServer\n"
        "async def m():\n s=MemServer(4<<20,lease_s=60,lock=False)\n h,p=await s.start()\n"
        " print(p,flush=True)\n await asyncio.Event().wait()\nasyncio.run(m())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, ("127.0.0.1", port)


async def test_frozen_memserver_is_cut_off_and_writes_continue(servers) -> None:
    _, addrs = servers
    proc, addr = _spawn_memserver()
    try:
        store = await RemoteStore.open(
            [addrs[0], addr],
            MiB,
            "t:frozen:1",
            replicas=2,
            slab_pages=64,
            op_timeout=0.5,
            repair=False,
        )
        data = os.urandom(PS)
        await store.write(0, memoryview(data))
        os.kill(proc.pid, signal.SIGSTOP)  # alive to TCP, answers nothing
        t0 = time.monotonic()
        await asyncio.wait_for(store.write(0, memoryview(data[::-1])), 10)
        assert time.monotonic() - t0 < 5  # the watchdog, not TCP_USER_TIMEOUT (15 s)
        assert store.counters()["stalls_aborted"] >= 1 and store.table.sets[0] == [0]
        out = bytearray(PS)
        await store.read(0, memoryview(out))
        assert out == data[::-1]
        os.kill(proc.pid, signal.SIGCONT)
        await store.close()
    finally:
        proc.kill()
        proc.wait()


async def test_statuses_agree_with_health(servers) -> None:
    _, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:status:1", replicas=3, slab_pages=64)
    try:
        await store.write(0, memoryview(os.urandom(MiB)))
        used = [(await query_status(*a))["used_pages"] for a in addrs]
        assert used == [256, 256, 256]
        h = store.health()
        assert h["replicas"] == 3 and h["degraded_slabs"] == 0 and h["pages_written"] == 256
        assert [p["slabs"] for p in h["peers"]] == [4, 4, 4]
    finally:
        await store.close()


# --- control socket ----------------------------------------------------------------------


async def test_control_socket_answers_status_owner_only(tmp_path, servers) -> None:
    from duvm.base import control_socket
    from duvm.node.daemon.status import daemon_status

    _, addrs = servers
    store = await RemoteStore.open(addrs[:2], MiB, "t:ctl:1", replicas=2, slab_pages=64)
    path = str(tmp_path / "d.sock.ctl")
    srv = await control_socket.start(path, lambda: daemon_status(store, None, 2).to_json())
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600
        st = await asyncio.to_thread(control_socket.query, path)
        assert st["replicas"] == 2 and st["store"]["degraded_slabs"] == 0 and st["nbd"] is None
        assert [p["slabs"] for p in st["store"]["peers"]] == [4, 4]

        def bad_request() -> bytes:
            import socket

            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                s.sendall(b"not json\n")
                return s.recv(4096)

        assert b"unknown request" in await asyncio.to_thread(bad_request)
    finally:
        srv.close()
        await store.close()


async def test_daemon_status_is_its_declared_shape_and_the_json_readers_know(servers) -> None:
    """Catches a status whose JSON drifts from what its readers parse (gputaskman's system
    panel reads "pid", "size_bytes", "replicas", "store" with its peers and "nbd"; `duvm
    status` reads "store" and "request_path") or whose replication report drifts from the
    declared `ReplicationHealth`, which the metrics collector indexes key by key."""
    import typing

    from duvm.node.daemon.nbdserver import NbdCounts, NBDServer
    from duvm.node.daemon.status import daemon_status
    from duvm.store.storage import PeerReplication, ReplicationHealth

    _, addrs = servers
    store = await RemoteStore.open(addrs[:2], MiB, "t:shape:1", replicas=2, slab_pages=64)
    try:
        await store.write(0, memoryview(os.urandom(8 * PS)))
        server = NBDServer(store)
        st = daemon_status(store, server, 2, "pure")
        assert st.replication is not None and st.nbd is not None
        assert set(st.replication) == set(typing.get_type_hints(ReplicationHealth))
        for p in st.replication["peers"]:
            assert set(p) == set(typing.get_type_hints(PeerReplication))
        assert set(st.nbd) == set(typing.get_type_hints(NbdCounts))
        assert (st.size_bytes, st.open_connections, st.counters) == (MiB, 0, store.counters())
        js = st.to_json()
        assert set(js) == {
            *("pid", "size_bytes", "replicas", "request_path", "store", "nbd", "workers")
        }
        assert (js["pid"], js["size_bytes"], js["replicas"]) == (os.getpid(), MiB, 2)
        assert js["workers"] is None  # one worker (the list with several: test_daemon_workers)
        assert js["request_path"] == "pure" and js["nbd"] == dict(st.nbd)
        # "store": the replication report with every layer's counters beside it, flat
        assert js["store"] == {**st.replication, **st.counters}
        assert js["store"]["pages_written"] == 8 and js["store"]["pages_lost_now"] == 0
        assert js["store"]["degraded_slabs"] == 0 and js["store"]["replicas"] == 2
        read_by_gputaskman = {"peer", "connected", "pages", "reserved_pages", "slabs"}
        assert all(read_by_gputaskman <= set(p) for p in js["store"]["peers"])
        assert sum(p["pages"] for p in js["store"]["peers"]) == 16  # 8 pages, 2 replicas
    finally:
        await store.close()


async def test_dead_peer_degrades_its_slabs_without_any_write(servers) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(
        addrs, MiB, "t:idle:1", replicas=2, slab_pages=64, op_timeout=0.4, seed=2
    )
    try:
        data = os.urandom(MiB)
        await store.write(0, memoryview(data))
        victim = store.table.sets[0][0]
        await srvs[victim].close()  # nobody reads or writes: the watchdog must notice
        await wait_for(
            lambda: (
                all(victim not in s for s in store.table.sets)
                and store.health()["degraded_slabs"] == 0
            ),
            20,
        )
        assert store.repairer.counters.repairs_done >= 1
        out = bytearray(MiB)
        await store.read(0, memoryview(out))
        assert out == data and store.counters()["failovers"] == 0  # nothing read the dead peer
    finally:
        await store.close()


async def test_slab_whose_replicas_outlive_their_lease_is_lost_then_replaced() -> None:
    a = MemServer(4 * MiB, lease_s=1, lock=False)  # a short lease: its pages go 1 s after
    b = MemServer(4 * MiB, lease_s=60, lock=False)
    addrs = [await a.start(), await b.start()]
    store = await RemoteStore.open(
        addrs, MiB, "t:gone:1", replicas=1, slab_pages=64, op_timeout=0.4, seed=1
    )
    try:
        data = os.urandom(MiB)
        await store.write(0, memoryview(data))
        on_a = [s for s, m in enumerate(store.table.sets) if m == [0]]
        assert on_a  # placement used both peers
        await a.close()  # for good
        t0 = time.monotonic()
        await wait_for(lambda: all(m == [1] for m in store.table.sets), 20)
        assert time.monotonic() - t0 > 1.0  # not before the lease could have run out
        assert store.repairer.counters.slabs_replaced == len(on_a)
        page = on_a[0] * 64
        with pytest.raises(StorageError, match="lost"):
            await store.read(page * PS, memoryview(bytearray(PS)))  # EIO, not zeros
        await store.write(page * PS, memoryview(b"n" * PS))  # writable again
        out = bytearray(PS)
        await store.read(page * PS, memoryview(out))
        assert out == b"n" * PS
        assert store.health()["pages_lost_now"] == len(on_a) * 64 - 1
    finally:
        await store.close()
        await b.close()


async def test_r1_read_waits_for_a_restarting_memserver_instead_of_failing() -> None:
    srv = MemServer(MiB, lease_s=60, lock=False)
    host, port = await srv.start()
    store = await RemoteStore.open([(host, port)], MiB, "t:wait:1", unreachable_wait=20)
    try:
        await store.write(0, memoryview(b"w" * PS))
        srv._server.close()  # stops listening for a while; the namespace stays (lease)
        for conn in srv.open_connections():
            conn.transport.abort()
        await asyncio.sleep(0.05)
        out = bytearray(PS)
        read = asyncio.ensure_future(store.read(0, memoryview(out)))
        await asyncio.sleep(1.0)
        assert not read.done()  # waiting, not failing
        await srv.start(host, port)  # listening again, same namespace
        await asyncio.wait_for(read, 10)
        assert out == b"w" * PS and store.counters()["unreachable_waits"] > 0
        assert store.counters()["read_errors"] == 0
    finally:
        await store.close()
        await srv.close()


# --- the callback fast path (start_read/start_write, what nbdconnection calls) ------------


async def test_fast_round_trip_completes_without_the_coroutine_path(servers, fast) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs[:1], MiB, "t:fast:1", replicas=1, slab_pages=64)
    try:
        data = os.urandom(8 * PS)
        assert await fast(store.start_write, 3 * PS, memoryview(data)) == "fast"
        assert await fast(store.start_write, 100 * PS, memoryview(data[:PS])) == "fast"
        ns = srvs[0].store.namespaces["t:fast:1"]
        assert set(ns.pages) == {*range(3, 11), 100}  # stored where the keys say
        out = bytearray(8 * PS)
        assert await fast(store.start_read, 3 * PS, memoryview(out)) == "fast"
        assert out == data
        one = bytearray(PS)
        assert await fast(store.start_read, 100 * PS, memoryview(one)) == "fast"
        assert one == data[:PS]
        assert store.counters()["stores"] == 2 and store.counters()["pages_stored"] == 9
        assert store.counters()["loads"] == 2 and store.counters()["pages_loaded"] == 9
        assert list(store.table.inflight) == [0] * store.table.nslabs  # every write accounted for
        # ... and the general path reads what the fast path wrote (same checksums)
        await store.read(3 * PS, memoryview(out))
        assert out == data
    finally:
        await store.close()


async def test_fast_path_declines_what_it_does_not_handle(servers) -> None:
    _, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:fast:2", replicas=2, slab_pages=64)
    try:
        buf = memoryview(bytearray(2 * PS))

        def never(tag: object, cont: object) -> None:
            raise AssertionError("declined requests must not complete")

        assert not store.start_read(0, buf, never, None)  # never written: zeros, no trip
        assert not store.start_write(63 * PS, buf, never, None)  # crosses a slab boundary
        await store.write(0, buf)
        await store.write(64 * PS, buf)
        assert not store.start_read(63 * PS, buf, never, None)  # crosses a slab boundary
        store.replication.repairs[0] = object()  # type: ignore[assignment] # a copy of slab 0 running
        assert not store.start_write(0, buf, never, None)  # under its lock: general path
        del store.replication.repairs[0]
        with pytest.raises(AssertionError, match="unaligned"):  # the NBD layer refuses it
            store.start_read(1, buf[:PS], never, None)
        await store.close()
        assert not store.start_read(0, buf, never, None)  # closed
    finally:
        await store.close()


async def test_fast_write_stores_on_every_replica_before_it_is_acknowledged(servers, fast) -> None:
    """Catches a replicated fast write acknowledged by the first replica's reply (a read of
    the other one could then miss the write) or left registered as in flight afterwards."""
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:fan:1", replicas=2, slab_pages=64)
    try:
        data = os.urandom(4 * PS)
        t = store.table
        assert await fast(store.start_write, 8 * PS, memoryview(data)) == "fast"
        assert t.pending_writes == {} and list(t.inflight) == [0] * t.nslabs
        holders = t.sets[0]
        assert len(holders) == 2
        for i in holders:  # byte for byte on both replicas, where the keys say
            ns, arena = srvs[i].store.namespaces["t:fan:1"], srvs[i].store.arena
            got = b"".join(bytes(arena.view(ns.pages[k])) for k in range(8, 12))
            assert got == data
        assert store.counters()["stores"] == 1 and store.counters()["pages_stored"] == 4
        out = bytearray(4 * PS)
        assert await fast(store.start_read, 8 * PS, memoryview(out)) == "fast"
        assert out == data
    finally:
        await store.close()


async def test_fast_write_with_a_replica_gone_continues_on_the_general_path(servers, fast) -> None:
    """Catches a replicated fast write that reports success (or fails) when one replica's
    connection breaks: the general path must send it again, drop that replica and answer
    from the survivor."""
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:fan:2", replicas=2, slab_pages=64)
    try:
        gone = store.table.sets[0][1]
        data = os.urandom(2 * PS)
        srvs[gone]._server.close()  # stops listening: the replica stays gone
        for conn in srvs[gone].open_connections():
            conn.transport.abort()  # the STORE on it fails after it was sent
        assert await fast(store.start_write, 0, memoryview(data)) == "continued"
        assert gone not in store.table.sets[0]  # dropped, the slab is degraded
        assert store.counters()["replicas_dropped"] == 1
        t = store.table
        assert t.pending_writes == {} and list(t.inflight) == [0] * t.nslabs
        out = bytearray(2 * PS)
        await store.read(0, memoryview(out))
        assert out == data
    finally:
        await store.close()


async def test_fast_read_of_a_corrupt_replica_fails_over_to_the_good_one(servers, fast) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:fast:3", replicas=2, slab_pages=64, seed=1)
    try:
        data = os.urandom(4 * PS)
        await store.write(0, memoryview(data))
        corrupt(srvs[store.table.sets[0][0]], "t:fast:3", 2)  # the preferred replica rots
        out = bytearray(4 * PS)
        assert await fast(store.start_read, 0, memoryview(out)) == "continued"
        assert out == data  # never the rotten bytes
        assert store.counters()["checksum_failures"] == 1
        assert store.counters()["replicas_dropped"] == 1
    finally:
        await store.close()


async def test_fast_read_with_no_good_copy_is_eio(servers, fast) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs[:1], MiB, "t:fast:4", replicas=1)
    try:
        await store.write(0, memoryview(b"q" * PS))
        corrupt(srvs[0], "t:fast:4", 0)
        out = bytearray(PS)
        with pytest.raises(StorageError) as ei:
            await fast(store.start_read, 0, memoryview(out))
        assert ei.value.errno == errno.EIO and "lost by every replica" in str(ei.value)
    finally:
        await store.close()


async def test_fast_write_to_a_dead_memserver_is_eio_and_the_pages_are_lost(servers, fast) -> None:
    srvs, addrs = servers
    store = await RemoteStore.open(addrs[:1], MiB, "t:fast:5", replicas=1, unreachable_wait=0.3)
    try:
        await store.write(0, memoryview(b"a" * PS))
        await srvs[0].close()
        with pytest.raises(StorageError) as ei:
            await fast(store.start_write, 0, memoryview(b"b" * PS))
        assert ei.value.errno == errno.EIO
        assert list(store.table.inflight) == [0] * store.table.nslabs
        # Neither the old nor the new bytes may be served now: the read is an error too.
        with pytest.raises(StorageError):
            await store.read(0, memoryview(bytearray(PS)))
    finally:
        await store.close()


async def test_a_read_racing_a_replicated_write_is_neither_eio_nor_a_dropped_replica(
    servers,
) -> None:
    """R=2: the preferred replica has stored a write while the other has not answered yet; a
    read of that page gets the new bytes from the first. Those bytes are the write's, not
    corruption: no EIO, no replica dropped, nothing marked lost."""
    srvs, addrs = servers
    store = await RemoteStore.open(addrs, MiB, "t:race:1", replicas=2, slab_pages=64, seed=2)
    try:
        old, new = os.urandom(PS), os.urandom(PS)
        await store.write(0, memoryview(old))
        first, second = store.table.sets[0]
        for conn in srvs[second].open_connections():  # the second replica is slow to answer
            conn.transport.pause_reading()
        write = asyncio.ensure_future(store.write(0, memoryview(new)))
        ns = srvs[first].store.namespaces["t:race:1"]
        await wait_for(lambda: bytes(srvs[first].store.arena.view(ns.pages[0])) == new)
        out = bytearray(PS)
        await store.read(0, memoryview(out))  # served by the first replica, mid-write
        assert bytes(out) == new
        for conn in srvs[second].open_connections():
            conn.transport.resume_reading()
        await write
        assert store.counters()["checksum_failures"] == 0
        assert store.counters()["replicas_dropped"] == 0 and store.counters()["pages_lost"] == 0
        assert store.table.sets[0] == [first, second]
        await store.read(0, memoryview(out))
        assert bytes(out) == new
    finally:
        await store.close()


async def test_close_right_after_a_replica_is_dropped_does_not_hang(servers) -> None:
    """Dropping a replica wakes the repairer; a close() at that moment must still stop it
    (asyncio.wait_for on Python 3.11 could swallow that cancel and loop forever)."""
    _, addrs = servers
    store = await RemoteStore.open(addrs[:2], MiB, "t:close:1", replicas=2, slab_pages=64)
    for slab in range(store.table.nslabs):
        store.replication.drop_replica(slab, store.table.sets[slab][0], "test")
    tasks = list(store._tasks)  # the watchdog and the repairer
    assert len(tasks) == 2
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await store.close()
    assert all(t.cancelled() for t in tasks)


class ReplyGate:
    """A TCP relay in front of a memserver whose replies can be held back: requests reach the
    memserver at once, its answers wait at the gate until it opens."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = asyncio.Event()
        self.open.set()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[:2]

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.target)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, gated: bool) -> None:
            try:
                while data := await r.read(65536):
                    if gated:
                        await self.open.wait()
                    w.write(data)
                    await w.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        for t in (pump(cr, sw, False), pump(sr, cw, True)):
            task = asyncio.ensure_future(t)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def test_a_replicated_write_waits_for_the_slowest_replica(memserver_pool) -> None:
    """Catches acknowledging a replicated write when the first replica answers: the kernel
    would then consider a page safe that one memserver does not hold yet, and losing the other
    memserver would lose it. (A status round trip after the write used to give the slow
    replica time to finish, so the earlier tests could not tell.)"""
    srvs, addrs = await memserver_pool(2, 4 * MiB)
    gate = ReplyGate(addrs[1])
    slow = await gate.start()
    store = await RemoteStore.open(
        [addrs[0], slow], MiB, "t:slowest:1", replicas=2, slab_pages=64, op_timeout=30, seed=1
    )
    try:
        data = os.urandom(2 * PS)
        gate.open.clear()  # the second memserver stores, but its acknowledgement is held
        write = asyncio.ensure_future(store.write(0, memoryview(data)))

        def held(srv: MemServer) -> bool:
            ns = srv.store.namespaces.get("t:slowest:1")
            return ns is not None and {0, 1} <= ns.pages.keys()

        await wait_for(lambda: held(srvs[1]))  # the slow memserver has stored the pages...
        assert held(srvs[0])  # ...and so has the fast one, whose answer is through
        await asyncio.sleep(0.3)
        assert not write.done(), "acknowledged before every replica stored the pages"
        gate.open.set()
        await asyncio.wait_for(write, 10)
        assert write.exception() is None
        assert store.health()["degraded_slabs"] == 0  # nobody was dropped on the way
        out = bytearray(2 * PS)
        await store.read(0, memoryview(out))
        assert out == data
    finally:
        gate.open.set()
        await store.close()
        await gate.close()
