"""The memserver on loopback: namespaces, reservations, batches, leases, bad peers, the CLI."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from duvm.base import pressure
from duvm.memserver.connection import Connection, _skip
from duvm.memserver.pagestore import PageStore, Refused
from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.memserver_status import query_status
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import NEED_DATA, Decoder
from duvm.wire.pageencode import encode_bytes, frame_header
from hypothesis import given, settings
from hypothesis import strategies as st
from memserver_relay import Relay

PS = pp.PAGE_SIZE


@pytest.fixture
async def server():
    srv = MemServer(4 << 20, lease_s=60, lock=False)  # 1024 pages
    addr = await srv.start()
    srv.addr = addr
    try:
        yield srv
    finally:
        await srv.close()


async def raw_exchange(
    addr: tuple[str, int], wire: bytes, replies: int = 1
) -> tuple[list[pp.Message], bool]:
    """Send raw bytes; collect up to `replies` replies; report whether the server closed."""
    reader, writer = await asyncio.open_connection(*addr)
    writer.write(wire)
    dec, got, closed = Decoder("client"), [], False
    try:
        while len(got) < replies:
            data = await asyncio.wait_for(reader.read(1 << 16), 5)
            if not data:
                closed = True
                break
            dec.receive_data(data)
            got += [m for m in iter(dec.next_event, NEED_DATA)]
        if not closed:
            closed = await asyncio.wait_for(reader.read(1), 0.3) == b""
    except TimeoutError:
        pass
    finally:
        writer.close()
    return got, closed


async def test_store_load_free_round_trip_with_batches(server: MemServer) -> None:
    c = MemClient(*server.addr, "node-a/nbd0/1")
    hello = await c.connect()
    assert (hello.version, hello.resumed, hello.capacity_pages) == (2, False, 1024)
    await c.reserve(100)
    data = os.urandom(64 * PS)
    await c.store(range(1000, 1064), data)
    assert await c.load(range(1000, 1064)) == data
    out = bytearray(2 * PS)
    await c.load([1063, 1000], out)
    assert out == data[63 * PS :] + data[:PS]
    assert await c.free([1000, 1001, 5]) == 2  # absent keys are not an error
    with pytest.raises(PageServerError) as ei:
        await c.load([1000])
    assert ei.value.code == pp.ErrorCode.NOT_FOUND and "1000" in str(ei.value)
    st = await c.status()
    assert (st["used_pages"], st["reserved_pages"], st["connections"]) == (62, 100, 1)
    assert st["namespaces"] == [
        {
            "client_id": "node-a/nbd0/1",
            "reserved_pages": 100,
            "stored_pages": 62,
            "connections": 1,
            "rdma_chunk_pages": None,
            "lease_expires_in": None,
        }
    ]
    assert await c.release() == 62
    st = await c.status()
    assert (st["used_pages"], st["reserved_pages"]) == (0, 0)
    await c.close()


async def test_batches_over_consecutive_and_scattered_slots(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/slots")
    await c.connect()
    await c.reserve(200)
    scattered = [os.urandom(PS) for _ in range(8)]
    for k in (7, 3, 5, 1, 6, 0, 2, 4):  # keys 0..7 land in slots out of key order
        await c.store([k], scattered[k])
    assert await c.load(range(8)) == b"".join(scattered)
    run = os.urandom(64 * PS)
    await c.store(range(100, 164), run)  # fresh slots, consecutive: copied as one run
    assert await c.load(range(100, 164)) == run
    assert await c.load([163, 100]) == run[63 * PS :] + run[:PS]
    await c.store(range(100, 164), run[::-1])  # overwrite in place
    assert await c.load(range(100, 164)) == run[::-1]
    slots = [server.store.namespaces["n/slots"].pages[k] for k in range(100, 164)]
    assert slots == list(range(slots[0], slots[0] + 64))
    await c.free(range(100, 164))
    await c.store(range(300, 364), run)  # freed slots come back in ascending order
    slots = [server.store.namespaces["n/slots"].pages[k] for k in range(300, 364)]
    assert slots == list(range(slots[0], slots[0] + 64))
    assert await c.load(range(300, 364)) == run
    await c.close()


async def test_overwrite_reuses_the_slot(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/1")
    await c.connect()
    await c.reserve(1)
    await c.store([7], b"a" * PS)
    await c.store([7], b"b" * PS)  # same key: no new page, so within a 1-page reservation
    assert await c.load([7]) == b"b" * PS
    assert server.store.arena.used_slots == 1
    await c.close()


async def test_many_requests_in_flight_on_one_connection(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/2")
    await c.connect()
    await c.reserve(512)
    pages = {k: os.urandom(PS) for k in range(256)}
    await asyncio.gather(*(c.store([k], v) for k, v in pages.items()))
    got = await asyncio.gather(*(c.load([k]) for k in pages))
    assert [bytes(g) for g in got] == list(pages.values())
    assert server.store.connections == 1
    await c.close()


async def test_concurrent_requests_merge_into_few_frames(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/merge")
    await c.connect()
    await c.reserve(64)
    pages = [os.urandom(PS) for _ in range(32)]
    await asyncio.gather(*(c.store([k], pages[k]) for k in range(32)))
    outs = [bytearray(PS) for _ in range(32)]
    await asyncio.gather(*(c.load([k], outs[k]) for k in reversed(range(32))))
    assert outs == pages  # each caller got its own page back out of the merged reply
    n = (await c.status())["counters"]
    assert (n["pages_stored"], n["pages_loaded"]) == (32, 32)
    assert n["store_requests"] < 32 and n["load_requests"] < 32  # merged on the wire
    await c.close()


async def test_a_load_answers_with_the_bytes_of_its_turn(server: MemServer) -> None:
    """LOAD replies are written from the arena without a copy; requests after a LOAD in the
    same read from the socket (an overwrite, a free whose slot a new page then reuses) must
    not change what that LOAD answers."""
    c = MemClient(*server.addr, "n/turn")
    await c.connect()
    await c.reserve(8)
    old, other, new, x = (os.urandom(PS) for _ in range(4))
    await c.store([1], old)
    await c.store([2], other)
    conns = server.open_connections()
    assert [conn.fd is not None for conn in conns] == [True]  # the writev path is on
    for conn in conns:  # hold: everything below arrives in one read
        conn.transport.pause_reading()
    ops = [
        asyncio.ensure_future(op)
        for op in (c.load([1]), c.store([1], new), c.load([1, 2]), c.free([2]), c.store([3], x))
    ]
    await asyncio.sleep(0.05)
    assert not any(op.done() for op in ops)
    for conn in conns:
        conn.transport.resume_reading()
    first, _, both, freed, _ = await asyncio.gather(*ops)
    assert bytes(first) == old
    assert bytes(both) == new + other
    assert freed == 1
    assert bytes(await c.load([1, 3])) == new + x
    await c.close()


@pytest.mark.parametrize("path", ["reference", "compiled"])
async def test_a_large_load_answers_with_the_bytes_of_its_turn(pick_path, path: str) -> None:
    """Catches, on the compiled memserver loop, a LOAD of more than `COPY_LOAD_PAGES` pages
    (sent as arena views, not copied) left uncopied when a STORE follows it in the same read:
    the compiled loop taking the frames after it again (its `not arena_views` guard dropped),
    or the copy made before a FREE but not before a STORE. The reply would then carry the
    overwritten page, or a freed slot's new page, instead of the bytes of its turn."""
    pick_path(path, "duvm.memserver._hotloop")
    srv = MemServer(4 << 20, lease_s=60, lock=False)
    addr = await srv.start()
    c = MemClient(*addr, "n/large-turn")
    try:
        await c.connect()
        await c.reserve(64)
        n = 32  # more than COPY_LOAD_PAGES: the reference loop answers it from the arena
        old = [os.urandom(PS) for _ in range(n)]
        await c.store(range(n), b"".join(old))
        new5, x = os.urandom(PS), os.urandom(PS)
        conns = srv.open_connections()
        assert [conn.fd is not None for conn in conns] == [True]  # the writev path is on
        assert (conns[0]._hot is not None) == (path == "compiled")
        for conn in conns:  # hold: everything below arrives in one read
            conn.transport.pause_reading()
        ops = []
        for op in (
            c.load(range(n)),
            c.store([5], new5),  # overwrites a slot the first reply still points into
            c.load(range(n)),
            c.free([7]),
            c.store([100], x),  # takes the slot key 7 just gave back
        ):
            ops.append(asyncio.ensure_future(op))
            await asyncio.sleep(0.01)  # sent in this order (FREE takes an extra task hop)
        assert not any(op.done() for op in ops)
        for conn in conns:
            conn.transport.resume_reading()
        first, _, second, freed, _ = await asyncio.gather(*ops)
        assert bytes(first) == b"".join(old)
        assert bytes(second) == b"".join(new5 if k == 5 else old[k] for k in range(n))
        assert freed == 1
        assert bytes(await c.load([5, 100])) == new5 + x
        # mechanism: the new page reused the freed slot, so the views really were at risk
        ns = srv.store.namespaces["n/large-turn"]
        assert ns.pages[100] == 7 and 7 not in ns.pages
    finally:
        await c.close()
        await srv.close()


class _FullSocketTransport:
    """Stands in for a transport whose socket is full (a peer that does not read): the kernel
    side of that cannot be held still deterministically on loopback, so the test sees what
    `Connection._send` hands over instead."""

    def __init__(self) -> None:
        self.queued: list = []

    def get_write_buffer_size(self) -> int:
        return 1  # data already queued: replies must go behind it, in order

    def writelines(self, bufs: list) -> None:
        self.queued += bufs


def test_replies_queued_behind_a_full_socket_are_copies_not_arena_views() -> None:
    store = PageStore(64, lock=False)
    ns, _ = store.attach("n/full")
    store.reserve(ns, 8)
    store.store(ns, (1, 2, 3), memoryview(b"a" * 3 * PS))
    conn = Connection.__new__(Connection)  # only _send is exercised
    conn.transport = _FullSocketTransport()  # type: ignore[assignment]
    conn.fd = -1  # never used: the queue is not empty, so no writev is tried
    views = store.load_views(ns, (1, 2, 3))
    assert [v.nbytes for v in views] == [3 * PS]  # consecutive slots: one view, no copy
    conn._send([b"header", *views])
    store.store(ns, (1, 2, 3), memoryview(b"b" * 3 * PS))  # the slots change afterwards
    sent = b"".join(bytes(b) for b in conn.transport.queued)
    assert sent == b"header" + b"a" * 3 * PS
    assert all(type(b) is bytes for b in conn.transport.queued)


def test_skip_drops_exactly_the_bytes_already_written() -> None:
    bufs = [b"abc", memoryview(b"defg"), b"hi"]
    for n in range(10):
        rest = _skip(bufs, n)
        assert b"".join(bytes(b) for b in rest) == b"abcdefghi"[n:]


async def wait_until(cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


class ShortLoads(Relay):
    """Cuts the last page off each successful LOAD reply of more than one page (and its length
    in the header): a memserver answering a LOAD with fewer pages than asked, as its client
    sees it."""

    shortened = 0

    def _pass(self, buf: bytearray) -> bytes:
        """The whole frames at the front of `buf` (taken out of it), LOAD replies cut short."""
        out = bytearray()
        while len(buf) >= pp.HEADER_SIZE:
            magic, mtype, flags, req_id, status, length = pp.HEADER.unpack_from(buf)
            end = pp.HEADER_SIZE + length
            if len(buf) < end:
                break
            if mtype == pp.MsgType.LOAD | pp.REPLY_BIT and status == 0 and length > PS:
                out += pp.HEADER.pack(magic, mtype, flags, req_id, status, length - PS)
                out += buf[pp.HEADER_SIZE : end - PS]
                self.shortened += 1
            else:
                out += buf[:end]
            del buf[:end]
        return bytes(out)

    async def down(self, s_r: asyncio.StreamReader, c_w: asyncio.StreamWriter) -> None:
        buf = bytearray()  # frame by frame
        while data := await s_r.read(1 << 16):
            buf += data
            c_w.write(self._pass(buf))


@pytest.mark.parametrize("path", ["reference", "compiled"])
async def test_a_reply_that_breaks_the_protocol_fails_its_request_not_hangs(
    server: MemServer, pick_path, path: str
) -> None:
    """A memserver answering a LOAD with fewer pages than asked (a relay cuts its reply
    short) is cut off; the request that reply belonged to fails like on a lost connection
    instead of waiting forever, on the client's reference reply loop and its compiled one."""
    pick_path(path, "duvm.store._replies")
    relay = ShortLoads(server.addr)
    c = MemClient(*await relay.start(), "n/short")
    try:
        await c.connect()
        await c.reserve(8)
        data = os.urandom(2 * PS)
        await c.store([1, 2], data)
        with pytest.raises(MemserverUnreachable, match=r"broke the protocol|lost"):
            async with asyncio.timeout(10):
                await c.load([1, 2])
        # tried twice (a request is retried once after a lost connection), each time on its
        # own connection, cut short each time
        assert (relay.shortened, relay.connections) == (2, 2)
        assert bytes(await c.load([1])) == data[:PS]  # reconnected and serving again
        assert (relay.shortened, relay.connections) == (2, 3)  # the broken one was dropped
    finally:
        await c.close()
        await relay.close()


async def test_a_refused_merged_batch_fails_only_the_requests_it_must(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/merge-err")
    await c.connect()
    await c.reserve(3)
    await c.store([0], b"0" * PS)
    res = await asyncio.gather(
        *(c.load([k], bytearray(PS)) for k in (0, 9, 0)), return_exceptions=True
    )
    assert res[0] is None and res[2] is None
    assert isinstance(res[1], PageServerError) and res[1].code == pp.ErrorCode.NOT_FOUND
    res = await asyncio.gather(
        *(c.store([k], bytes([k]) * PS) for k in (1, 2, 3)), return_exceptions=True
    )
    assert res[:2] == [None, None]  # two new pages fit the 3-page reservation, the third not
    assert isinstance(res[2], PageServerError) and res[2].code == pp.ErrorCode.NO_SPACE
    assert await c.load([1, 2]) == b"\1" * PS + b"\2" * PS
    # each merged frame was refused once, then the one bad request again on its own
    assert (await c.status())["counters"]["refused"] == 4
    await c.close()


async def test_namespaces_are_separate(server: MemServer) -> None:
    a, b = MemClient(*server.addr, "node-a/1"), MemClient(*server.addr, "node-b/1")
    await a.connect()
    await b.connect()
    await a.reserve(10)
    await b.reserve(10)
    await a.store([1], b"A" * PS)
    await b.store([1], b"B" * PS)
    assert await a.load([1]) == b"A" * PS and await b.load([1]) == b"B" * PS
    await b.free([1])
    assert await a.load([1]) == b"A" * PS
    await a.close()
    await b.close()


async def test_reservations_never_exceed_the_arena(server: MemServer) -> None:
    a, b = MemClient(*server.addr, "a"), MemClient(*server.addr, "b")
    await a.connect()
    await b.connect()
    await a.reserve(1000)
    with pytest.raises(PageServerError) as ei:
        await b.reserve(25)
    assert ei.value.code == pp.ErrorCode.NO_SPACE and "24 available of 1024" in str(ei.value)
    assert (await b.reserve(24)).reserved_pages == 24
    await a.reserve(900)  # shrinking gives room back
    assert (await b.reserve(124)).reserved_pages == 124
    await a.store([1, 2], bytes(2 * PS))
    with pytest.raises(PageServerError) as ei:
        await a.reserve(1)
    assert ei.value.code == pp.ErrorCode.BUSY
    await a.close()
    await b.close()


async def test_store_beyond_reservation_is_refused_whole(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/3")
    await c.connect()
    await c.reserve(3)
    await c.store([1, 2], bytes(2 * PS))
    with pytest.raises(PageServerError) as ei:
        await c.store([2, 3, 4], b"x" * 3 * PS)  # 2 new pages, 1 left
    assert ei.value.code == pp.ErrorCode.NO_SPACE and ei.value.errno == 28
    assert await c.load([2]) == bytes(PS)  # nothing of the refused batch was applied
    assert server.store.arena.used_slots == 2
    await c.store([3, 3, 3], b"x" * PS + b"y" * PS + b"z" * PS)  # duplicates count once
    assert server.store.arena.used_slots == 3
    assert await c.load([3]) == b"z" * PS  # the last copy wins
    with pytest.raises(PageServerError):
        await MemClient(*server.addr, "none").store([1], bytes(PS))  # never connected
    await c.close()


async def test_lease_keeps_pages_for_a_reconnect_then_frees_them() -> None:
    srv = MemServer(1 << 20, lease_s=0.5, lock=False)
    addr = await srv.start()
    try:
        c = MemClient(*addr, "node-a/nbd0/7")
        await c.connect()
        await c.reserve(8)
        await c.store([5], b"k" * PS)
        await c.close()
        st = await query_status(*addr)
        ns = st["namespaces"][0]
        assert ns["connections"] == 0 and 0 < ns["lease_expires_in"] <= 0.5
        hello = await c.connect()  # same client id within the lease
        assert (hello.resumed, hello.reserved_pages, hello.stored_pages) == (True, 8, 1)
        assert await c.load([5]) == b"k" * PS
        await c.close()
        await asyncio.sleep(0.8)
        st = await query_status(*addr)
        assert (st["namespaces"], st["used_pages"], st["reserved_pages"]) == ([], 0, 0)
        hello = await c.connect()
        assert (hello.resumed, hello.stored_pages) == (False, 0)
        await c.close()
    finally:
        await srv.close()


async def test_empty_namespace_is_dropped_at_disconnect(server: MemServer) -> None:
    c = MemClient(*server.addr, "tmp")
    await c.connect()
    await c.close()
    await asyncio.sleep(0.05)
    assert (await query_status(*server.addr))["namespaces"] == []


async def test_version_mismatch_is_refused_clearly(server: MemServer) -> None:
    # a version-1 client (HELLO without nonce) is told why, then disconnected
    v1 = frame_header(pp.MsgType.HELLO, 1, 9) + struct.pack("<HHHH", 1, 1, 1, 0) + b"x"
    got, closed = await raw_exchange(server.addr, v1)
    assert closed and len(got) == 1
    err = got[0]
    assert isinstance(err, pp.ErrorReply) and err.code == pp.ErrorCode.VERSION
    assert "client speaks 1..1, server 2..2" in err.message


async def test_request_before_hello_closes(server: MemServer, caplog) -> None:
    caplog.set_level(logging.WARNING, "duvm.memserver")
    got, closed = await raw_exchange(server.addr, encode_bytes(pp.make_load(1, [1])))
    assert closed and got == []
    assert "Load before authentication" in caplog.text


async def test_status_needs_no_hello(server: MemServer) -> None:
    st = await query_status(*server.addr)
    assert st["capacity_pages"] == 1024 and st["locked"] is False
    assert st["lock_error"] == "locking disabled"


@pytest.mark.parametrize(
    "wire,reason",
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad magic"),
        (pp.HEADER.pack(pp.MAGIC, pp.MsgType.STORE, 0, 1, 0, 1 << 30), "exceeds the limit"),
        (encode_bytes(pp.Hello(1, "g")) + encode_bytes(pp.Hello(2, "g")), "second HELLO"),
        (
            encode_bytes(pp.Hello(1, "g"))
            + encode_bytes(pp.Auth(2, bytes(32)))
            + encode_bytes(pp.make_store(3, [1], bytes(PS)))[:-7],
            "closed inside a frame",
        ),
    ],
    ids=["garbage", "oversized", "second-hello", "truncated"],
)
async def test_bad_client_is_cut_off_while_a_good_one_keeps_working(
    server: MemServer, caplog, wire: bytes, reason: str
) -> None:
    caplog.set_level(logging.WARNING, "duvm.memserver")
    good = MemClient(*server.addr, "good/1")
    await good.connect()
    await good.reserve(64)
    page = os.urandom(PS)
    await good.store([1], page)

    async def good_traffic() -> None:
        for i in range(50):
            await good.store([i % 64], page)
            assert await good.load([i % 64]) == page

    async def bad_peer() -> bool:
        reader, writer = await asyncio.open_connection(*server.addr)
        writer.write(wire)
        await writer.drain()
        if reason == "closed inside a frame":
            writer.write_eof()
        await asyncio.wait_for(reader.read(), 5)  # returns only once the server closed
        writer.close()
        return True

    _, closed = await asyncio.gather(good_traffic(), bad_peer())
    assert closed
    assert reason in caplog.text and "closing connection from" in caplog.text
    assert await good.load([1]) == page
    st = await good.status()
    assert st["connections"] == 1 and [n["client_id"] for n in st["namespaces"]] == ["good/1"]
    await good.close()


async def test_client_reconnects_and_retries_after_a_dropped_connection(server: MemServer) -> None:
    c = MemClient(*server.addr, "n/retry")
    await c.connect()
    await c.reserve(4)
    await c.store([1], b"r" * PS)
    for conn in server.open_connections():  # the server drops the connection
        conn.transport.abort()
    await asyncio.sleep(0.05)
    assert not c.connected
    assert await c.load([1]) == b"r" * PS  # reconnected, same namespace, pages there
    assert c.hello.resumed and c.namespace_losses == 0
    await c.close()


async def test_unreachable_memserver_is_a_clear_error() -> None:
    c = MemClient("127.0.0.1", 1, "x", connect_timeout=2)
    with pytest.raises(MemserverUnreachable, match=r"cannot reach memserver 127\.0\.0\.1:1"):
        await c.connect()
    with pytest.raises(MemserverUnreachable):
        await query_status("127.0.0.1", 1)


# --- the command line ---


def start_cli(*args: str) -> tuple[subprocess.Popen, tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "duvm.cli", "memserver", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    m = re.search(r"listening on ([\d.]+):(\d+) capacity (\d+) pages", line)
    if not m:
        proc.kill()
        raise AssertionError(f"no listening line: {line!r} {proc.stderr.read()}")
    return proc, (m.group(1), int(m.group(2)))


async def test_cli_serves_and_stops_cleanly_on_sigterm() -> None:
    proc, addr = start_cli("--listen", "127.0.0.1:0", "--capacity", "8M", "--lease", "5")
    try:
        st = await query_status(*addr)
        assert (st["capacity_pages"], st["lease_seconds"]) == (2048, 5.0)
        c = MemClient(*addr, "cli/1")
        await c.connect()
        await c.reserve(2)
        await c.store([0, 1], os.urandom(2 * PS))
        assert (await c.status())["used_pages"] == 2
        await c.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
    assert rc == 0


def _can_lower_oom_scores() -> bool:
    """CAP_SYS_RESOURCE (bit 24 of CapEff): without it no process may go below 0."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def test_a_locked_memserver_is_last_in_the_oom_killers_list() -> None:
    """Catches a memserver the OOM killer picks first: on a node that serves itself it is the
    biggest process, and the score is also what keeps it out of the supervisor's choice when
    a crashed daemon's restart is short of memory (duvm.node.lifecycle.room), which would
    otherwise end the pages' holder instead of a program. Locked like the daemon, it is as
    far down the list; where the score cannot be lowered (no CAP_SYS_RESOURCE, as in some
    containers) it says so."""
    if os.geteuid() != 0:
        pytest.skip("locking the memserver needs root")
    proc, _ = start_cli("--listen", "127.0.0.1:0", "--capacity", "8M", "--insecure")
    plain, _ = start_cli("--listen", "127.0.0.1:0", "--capacity", "8M", "--insecure", "--no-mlock")
    try:
        adj = Path(f"/proc/{proc.pid}/oom_score_adj").read_text().strip()
        # one that was told not to lock is an ordinary process, as asked
        assert Path(f"/proc/{plain.pid}/oom_score_adj").read_text().strip() == "0"
    finally:
        for p in (proc, plain):
            p.send_signal(signal.SIGTERM)
            assert p.wait(10) == 0
    err = proc.stderr.read()
    if _can_lower_oom_scores():
        assert adj == str(pressure.OOM_SCORE_ADJ), err
        assert "OOM killer" not in err
    else:
        assert adj == "0"
        assert (
            "the OOM killer may pick the memserver (oom_score_adj: Permission denied; lowering it "
            "needs CAP_SYS_RESOURCE)" in err
        )
    assert "OOM killer" not in plain.stderr.read()


@pytest.mark.parametrize(
    "args,code,msg",
    [
        # bad arguments exit 2; a port that cannot be bound or too much capacity exit 1
        (["--listen", "127.0.0.1", "--capacity", "8M"], 2, "needs a port"),
        (["--listen", "127.0.0.1:0", "--capacity", "lots"], 2, "not a size"),
        (["--listen", "127.0.0.1:0", "--capacity", "100"], 2, "less than one page"),
        (["--listen", "127.0.0.1:0", "--capacity", "8M", "--lease", "0"], 2, "must be positive"),
        (
            ["--listen", "192.0.2.1:0", "--capacity", "8M", "--insecure"],
            1,
            "cannot listen on 192.0.2.1:0",
        ),
        (["--listen", "192.0.2.1:0", "--capacity", "8M"], 2, "without authentication"),
        (["--listen", "127.0.0.1:0", "--capacity", "64T"], 1, "exceeds this node's available"),
    ],
)
def test_cli_bad_arguments_exit_nonzero_with_a_reason(args: list[str], code: int, msg: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "duvm.cli", "memserver", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == code, proc.stderr
    assert msg in proc.stderr and "Traceback" not in proc.stderr


# --- the page store's invariants under random operations (no network) ---

_ops = st.lists(
    st.tuples(
        st.sampled_from(["store", "free", "load", "reserve", "release"]),
        st.sampled_from(["a", "b"]),
        st.lists(st.integers(0, 40), min_size=1, max_size=12),
        st.integers(0, 48),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_page_store_matches_a_model_and_never_shares_slots(ops: list) -> None:
    ps = PageStore(64, lock=False)
    try:
        nss = {cid: ps.attach(cid)[0] for cid in ("a", "b")}
        model: dict[str, dict[int, bytes]] = {"a": {}, "b": {}}
        reserved = {"a": 0, "b": 0}
        for i, (op, cid, keys, n) in enumerate(ops):
            ns, m = nss[cid], model[cid]
            if op == "store":
                data = b"".join(bytes([i % 251, k % 251]) * (PS // 2) for k in keys)
                new = len(set(keys) - m.keys())
                try:
                    ps.store(ns, tuple(keys), memoryview(data))
                    assert len(m) + new <= reserved[cid]
                    for j, k in enumerate(keys):
                        m[k] = data[j * PS : (j + 1) * PS]
                except Refused as e:
                    assert e.code == pp.ErrorCode.NO_SPACE and len(m) + new > reserved[cid]
            elif op == "free":
                assert ps.free(ns, tuple(keys)) == len(set(keys) & m.keys())
                for k in keys:
                    m.pop(k, None)
            elif op == "load":
                if all(k in m for k in keys):
                    assert ps.load(ns, tuple(keys)) == b"".join(m[k] for k in keys)
                else:
                    with pytest.raises(Refused):
                        ps.load(ns, tuple(keys))
            elif op == "reserve":
                other = reserved["b" if cid == "a" else "a"]
                try:
                    ps.reserve(ns, n)
                    reserved[cid] = n
                except Refused:
                    assert n < len(m) or n + other > 64
            else:
                assert ps.release(ns) == len(m)
                m.clear()
                reserved[cid] = 0
            # invariants: accounting, reservation, and one slot per stored page
            slots = [s for x in nss.values() for s in x.pages.values()]
            assert len(slots) == len(set(slots)) == ps.arena.used_slots
            assert ps.reserved_total == sum(reserved.values()) <= 64
            assert all(len(nss[c].pages) <= reserved[c] for c in nss)
    finally:
        ps.close()
