"""FENCE: once a newer daemon generation fences a namespace, a memserver refuses every change of
it from connections of an older generation, on both memserver loops (the reference and the
compiled `_hotloop`), with real memservers and real MemClients on loopback.

The scenario it exists for: a daemon is SIGKILLed, the standby takes over and the kernel
resends the writes that were in flight to it; the dead daemon's STOREs may still sit in its
dead socket's send buffer and reach the memserver after the standby's newer STORE of the same
page, on another connection. Fenced, they are refused instead of overwriting the new bytes.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memclient_group import fence_all
from duvm.store.memserver_errors import PageServerError
from duvm.store.pool import Pool
from duvm.testing.fake_verbs import FakeVerbs, RemoteAccessError
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import Decoder
from duvm.wire.pageencode import encode_bytes, frame_header
from memserver_raw import raw_conn

PS = pp.PAGE_SIZE
CP = 16  # RDMA chunk pages
PATHS = pytest.mark.parametrize("path", ["reference", "compiled"])
FENCED = pp.ErrorCode.FENCED


def page(c: bytes) -> bytes:
    return c * PS


async def until(cond, what: str, timeout: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"gave up waiting for {what}") from None


async def refused(coro, code: pp.ErrorCode = FENCED) -> PageServerError:
    with pytest.raises(PageServerError) as ei:
        await coro
    assert ei.value.code == code, ei.value
    return ei.value


@pytest.fixture
async def srv():
    s = MemServer(256 * PS, lease_s=60, lock=False)
    s.addr = await s.start()
    try:
        yield s
    finally:
        await s.close()


# --- the codec -------------------------------------------------------------------------------


def test_fence_round_trips_and_refuses_epoch_zero() -> None:
    for role, msg in (("server", pp.Fence(7, 2**64 - 1)), ("client", pp.FenceReply(7, 3))):
        wire = encode_bytes(msg)
        assert len(wire) == pp.HEADER_SIZE + 16
        dec = Decoder(role)
        dec.receive_data(wire)
        assert dec.next_event() == msg
    for bad in (0, -1, 2**64, True):
        with pytest.raises(pp.LocalProtocolError):
            pp.Fence(1, bad)
    assert pp.ErrorCode.FENCED == 9 and pp.MsgType.FENCE == 11


# --- the memserver's rules, through real clients ---------------------------------------------


@PATHS
async def test_a_fenced_namespace_refuses_the_old_generations_changes(
    srv: MemServer, pick_path, path: str
) -> None:
    """Catches a memserver loop that lets a connection of an older epoch change a fenced
    namespace: STORE or FREE served by the compiled loop (its `writable` ignored) or by the
    reference one (its epoch check on STORE/FREE dropped), RESERVE or RELEASE not checked in
    `_dispatch`, or a FENCE with a lower epoch granted. LOAD stays allowed; a client that never
    fences works while the namespace's epoch is 0."""
    pick_path(path, "duvm.memserver._hotloop")
    a = MemClient(*srv.addr, "n/gen")  # the old generation: never fences (an old client)
    b = MemClient(*srv.addr, "n/gen")  # the new one: same namespace, same token
    try:
        await a.connect()
        await a.reserve(8)
        await a.store([1], page(b"a"))  # epoch 0: an unfenced client works
        await a.store([2, 3], page(b"2") + page(b"3"))
        assert await a.free([3]) == 1
        (conn_a,) = srv.open_connections()
        assert (conn_a._hot is not None) == (path == "compiled")
        await b.connect()
        assert await b.fence(1) == 1
        ns = srv.store.namespaces["n/gen"]
        assert ns.epoch == 1 and conn_a.epoch == 0
        await refused(a.store([1], page(b"b")))
        assert bytes(await a.load([1])) == page(b"a")  # LOAD is allowed, the page unchanged
        await b.store([1], page(b"c"))
        assert bytes(await a.load([1])) == page(b"c")
        await refused(a.free([2]))
        await refused(a.reserve(16))
        await refused(a.release())
        await refused(a.store([4, 5], page(b"x") * 2))  # a batch, and a new key
        assert bytes(await b.load([1, 2])) == page(b"c") + page(b"2")
        assert (sorted(ns.pages), ns.reserved) == ([1, 2], 8)
        st = await a.status()  # STATUS is allowed
        assert st["counters"]["fenced_refused"] == 5
        # a lower epoch is a stale generation: refused, nothing changes
        assert await b.fence(3) == 3
        assert await b.fence(3) == 3  # the same epoch again: fine
        e = await refused(a.fence(2))
        assert "stale" in e.message and a.fenced_out is not None
        assert ns.epoch == 3
        await refused(a.load([1]))  # a refused FENCE stops that client for good, locally
        await b.store([2], page(b"d"))
        assert bytes(await b.load([2])) == page(b"d")
    finally:
        await a.close()
        await b.close()


@PATHS
async def test_an_old_store_arriving_after_the_fence_never_overwrites_the_new_one(
    srv: MemServer, pick_path, path: str
) -> None:
    """The ordering property. The old generation's STORE (and a FREE) is held in its socket
    (the memserver does not read that connection) while the new generation fences and stores
    the same page; then it arrives. Catches either loop serving it, the old bytes overwriting
    the new (the compiled loop taking the frames of a fenced-off connection, the reference
    loop not checking the epoch on STORE or FREE)."""
    pick_path(path, "duvm.memserver._hotloop")
    a = MemClient(*srv.addr, "n/order")
    b = MemClient(*srv.addr, "n/order", epoch=7)
    try:
        await a.connect()
        await a.reserve(8)
        await a.store([1, 2], page(b"o") * 2)
        (conn_a,) = srv.open_connections()
        assert (conn_a._hot is not None) == (path == "compiled")
        conn_a.transport.pause_reading()  # a's next frames wait in the socket, as in a crash
        late = [
            asyncio.ensure_future(a.store([1], page(b"L"))),
            asyncio.ensure_future(a.free([2])),
            asyncio.ensure_future(a.store([3], page(b"N"))),
        ]
        for _ in range(5):
            await asyncio.sleep(0.01)  # sent, in this order, into the unread socket
        assert not any(f.done() for f in late)
        await b.connect()  # fences at 7 before anything else
        await b.store([1], page(b"n"))
        conn_a.transport.resume_reading()  # the old frames arrive after the fence
        res = await asyncio.gather(*late, return_exceptions=True)
        assert [getattr(r, "code", r) for r in res] == [FENCED] * 3
        assert bytes(await b.load([1, 2])) == page(b"n") + page(b"o")
        await refused(b.load([3]), pp.ErrorCode.NOT_FOUND)
    finally:
        await a.close()
        await b.close()


@PATHS
async def test_a_client_with_an_epoch_fences_every_new_connection_first(
    srv: MemServer, pick_path, path: str
) -> None:
    """Catches a MemClient that fences only its first connection (after the memserver drops
    it, the reconnected one has epoch 0 and all its writes are refused), or that sends FENCE
    after another request (the one that made it reconnect, or a fast-path STORE sent as soon
    as the client looks connected: either would be refused), and a stale
    client (FENCE refused at connect) that keeps reconnecting or is let write."""
    pick_path(path, "duvm.memserver._hotloop")
    b = MemClient(*srv.addr, "n/re", epoch=1)
    a = MemClient(*srv.addr, "n/re")
    stale = MemClient(*srv.addr, "n/re", epoch=1)
    try:
        await b.connect()
        await b.reserve(8)
        ns = srv.store.namespaces["n/re"]
        assert ns.epoch == 1
        for _ in range(2):
            (conn,) = srv.open_connections()
            assert conn.epoch == 1
            conn.abort()  # the memserver drops it: b's next request reconnects
            await until(lambda: not b.connected, "b to see its connection gone")
            await b.store([1], page(b"b"))  # reconnect, FENCE, then this STORE
            (conn,) = srv.open_connections()
            assert conn.epoch == 1 and bytes(await b.load([1])) == page(b"b")
        # the fast path (the daemon's) goes out as soon as the client looks connected: that
        # must be after the FENCE, or the memserver refuses it
        (conn,) = srv.open_connections()
        conn.abort()
        await until(lambda: not b.connected, "b's connection gone")
        reconnect = asyncio.ensure_future(b.probe())
        await until(lambda: b.hello is not None, "b to look connected", timeout=5)
        await b.store_batch((3,), memoryview(page(b"f")))
        assert await reconnect
        await a.connect()
        await refused(a.store([1], page(b"a")))
        # the standby takes over at run time: the live connection is fenced at once
        assert await b.set_epoch(2) == 2 and ns.epoch == 2
        conns = [c for c in srv.open_connections() if c.epoch == 2]
        assert len(conns) == 1
        conns[0].abort()
        await until(lambda: not b.connected, "b's connection gone")
        await b.store([2], page(b"2"))  # reconnected with the new epoch
        # a client of an older generation: its FENCE at connect is refused, for good
        await refused(stale.connect())
        assert stale.fenced_out is not None and not stale.connected
        n_conns = len(srv.open_connections())
        await refused(stale.store([1], page(b"s")))  # at once, no connect tried
        assert not await stale.probe()
        assert len(srv.open_connections()) == n_conns
        assert bytes(await b.load([1, 2, 3])) == page(b"b") + page(b"2") + page(b"f")
    finally:
        for c in (a, b, stale):
            await c.close()


async def test_fence_all_fences_every_reachable_peer_and_reports_the_rest() -> None:
    """Catches `fence_all` raising for one unreachable memserver (the others then go
    unfenced), or not recording the epoch on a client it could not reach (its reconnect would
    not fence)."""
    s1, s2 = (MemServer(64 * PS, lease_s=60, lock=False) for _ in range(2))
    a1 = await s1.start()
    a2 = await s2.start()
    pool = Pool([a1, a2], "n/pool", pages=8)
    try:
        await pool.open()
        await pool.store(1, page(b"p"))
        await s2.close()  # one memserver gone
        await until(lambda: not pool.clients[1].connected, "the lost connection")
        res = await pool.fence_all(4)
        assert res[0] == 4 and res[1] is None, res
        assert [c.epoch for c in pool.clients] == [4, 4]
        assert s1.store.namespaces["n/pool"].epoch == 4
        never = MemClient(*a2, "n/pool")  # never connected
        res = await fence_all([pool.clients[0], never], 5)
        assert res == [5, None] and never.epoch == 5
        stale = MemClient(*a1, "n/pool")
        await stale.connect()
        res = await fence_all([stale], 3)  # below the namespace's 5: refused, not raised
        assert [getattr(r, "code", r) for r in res] == [FENCED]
        assert stale.fenced_out is not None
        await stale.close()
    finally:
        await pool.close()
        await s1.close()


async def test_a_fenced_off_connections_rdma_regions_are_dropped() -> None:
    """Through a real memserver (the fake verbs device for rdma-cm). Catches the regions of a
    stale connection outliving the FENCE (its queue pair could still RDMA WRITE the namespace,
    unseen by the memserver), a RESERVE of the new generation registering the new extents in
    the stale session again, RDMA_MAP / RDMA_OPEN granted to a fenced-off connection, and a
    ticket handed out before the fence still accepted after it."""
    srv = MemServer(256 * PS, lease_s=60, lock=False)
    nic = FakeVerbs()
    addr = await srv.start()
    assert srv.start_rdma(*addr, required=True, load_verbs=lambda: nic)
    a, a2, b = (MemClient(*addr, "n/rdma") for _ in range(3))
    try:
        await a.connect()
        ticket = (await a._request(pp.RdmaOpen(0, CP))).ticket
        await a.reserve(2 * CP)
        end_a = nic.connect(ticket)
        await until(lambda: srv.rdma.status()["sessions"] == 1, "a's session")
        m = await a._request(pp.RdmaMap(0, 1))
        end_a.write(m.address, page(b"a"), m.rkey)  # the old generation writes by RDMA
        await a2.connect()
        late_ticket = (await a2._request(pp.RdmaOpen(0, CP))).ticket  # before the fence
        await b.connect()
        assert await b.fence(1) == 1
        with pytest.raises(RemoteAccessError):
            end_a.write(m.address, page(b"X"), m.rkey)
        with pytest.raises(RemoteAccessError):
            end_a.read(m.address, PS, m.rkey)
        await refused(a._request(pp.RdmaMap(0, 1)))
        await refused(a._request(pp.RdmaOpen(0, CP)))
        await b.reserve(4 * CP)  # new extents: registered for b's sessions only
        ns = srv.store.namespaces["n/rdma"]
        (sess_a,) = [s for s in srv.rdma._sessions.values() if s.ns is ns]
        assert not sess_a.regions
        end_late = nic.connect(late_ticket)
        await asyncio.sleep(0.05)
        assert end_late.state == "rejected"
        # the new generation gets RDMA as usual
        ticket_b = (await b._request(pp.RdmaOpen(0, CP))).ticket
        end_b = nic.connect(ticket_b)
        await until(lambda: srv.rdma.status()["sessions"] == 2, "b's session")
        mb = await b._request(pp.RdmaMap(0, 1))
        end_b.write(mb.address, page(b"b"), mb.rkey)
        assert bytes(await b.load([CP])) == page(b"b")
        assert not sess_a.regions
    finally:
        for c in (a, a2, b):
            await c.close()
        await srv.close()


# --- malformed frames ------------------------------------------------------------------------


@PATHS
async def test_malformed_fence_frames_are_answered_invalid_and_serving_goes_on(
    srv: MemServer, pick_path, path: str
) -> None:
    """Catches a memserver that crashes, hangs or silently accepts on a bad FENCE: a short
    body, epoch 0 or reserved bits set must be answered INVALID with nothing changed, the
    connection still serving; a body longer than its limit is refused from the header (the
    connection closes) and the server serves others."""
    pick_path(path, "duvm.memserver._hotloop")
    ask, writer = await raw_conn(srv.addr)
    try:
        assert isinstance(await ask(pp.Hello(1, "n/raw")), pp.Challenge)
        assert isinstance(await ask(pp.Auth(2, bytes(32))), pp.HelloReply)
        fence = int(pp.MsgType.FENCE)
        bad = [
            frame_header(fence, 10, 8) + (5).to_bytes(8, "little"),  # short body
            frame_header(fence, 11, 0),  # empty
            frame_header(fence, 12, 16) + pp.FENCE_BODY.pack(0, 0, 0),  # epoch 0
            frame_header(fence, 13, 16) + pp.FENCE_BODY.pack(5, 1, 0),  # reserved bits
            frame_header(fence, 14, 16) + pp.FENCE_BODY.pack(5, 0, 1 << 31),
        ]
        for i, wire in enumerate(bad, start=10):
            r = await ask(wire)
            assert isinstance(r, pp.ErrorReply), r
            assert (r.req_id, r.type, r.code) == (i, pp.MsgType.FENCE, pp.ErrorCode.INVALID)
        ns = srv.store.namespaces["n/raw"]
        assert ns.epoch == 0
        assert await ask(pp.Fence(20, 5)) == pp.FenceReply(20, 5)
        r = await ask(pp.Fence(21, 4))
        assert isinstance(r, pp.ErrorReply) and r.code == FENCED and ns.epoch == 5
        assert isinstance(await ask(pp.Reserve(22, 4)), pp.ReserveReply)
        assert isinstance(await ask(pp.make_store(23, [1], page(b"r"))), pp.StoreReply)
        # over its limit: refused from the header, this connection only
        assert await ask(frame_header(fence, 30, 24) + bytes(24)) is None
    finally:
        writer.close()
    c = MemClient(*srv.addr, "n/other")
    try:
        await c.connect()
        await c.reserve(1)
        await c.store([1], page(b"o"))
        assert bytes(await c.load([1])) == page(b"o")
    finally:
        await c.close()


async def test_a_fence_before_authentication_closes_the_connection(srv: MemServer) -> None:
    """Catches FENCE (good or bad) served before the handshake: no namespace, no epoch."""
    for wire in (encode_bytes(pp.Fence(1, 1)), frame_header(int(pp.MsgType.FENCE), 1, 0)):
        ask, writer = await raw_conn(srv.addr)
        try:
            assert await ask(wire) is None
        finally:
            writer.close()
    assert not srv.store.namespaces
    assert srv.counters["unauthenticated_requests"] == 2


async def test_the_epoch_outlives_the_connections_for_the_lease(srv: MemServer) -> None:
    """Catches the epoch kept on the connection rather than the namespace: after every
    connection is gone and the namespace resumes within its lease, an old-generation client
    could write again. (A namespace that holds nothing, not even a reservation, goes with its
    last connection as before: nobody's bytes are left to protect, and a clean stop's RELEASE
    leaves nothing behind.)"""
    b = MemClient(*srv.addr, "n/lease", epoch=2)
    await b.connect()
    await b.reserve(4)
    await b.close()
    await until(lambda: srv.store.namespaces["n/lease"].connections == 0, "the detach")
    assert srv.store.namespaces["n/lease"].epoch == 2
    a = MemClient(*srv.addr, "n/lease")
    try:
        hello = await a.connect()
        assert hello.resumed
        await refused(a.reserve(4))
        await refused(a.store([1], os.urandom(PS)))
    finally:
        await a.close()
