"""Safety rules of authentication, page encryption and repair that no other fast test guards.

Each test drives real parts: a real in-process `MemServer` on loopback and the real handshake
functions of `duvm.wire.auth`, a `CryptStore` over a `MemoryStore`, and a `RemoteStore` with
two replicas over three real memservers with a real `Repairer`. No root, swap or QEMU. The
races with the repair copy are ordered by holding one step (the copier's LOAD, a write's
STORE) on an event, so a passing run never depends on timing (the in-flight test gives a copy
that does not wait a 1 s window to start reading; it needs a few loopback round trips); each
replica's copy is then read straight from its memserver's page store.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import time

import pytest
from duvm.memserver.server import MemServer
from duvm.store.crypt_store import META, CryptStore
from duvm.store.memory_store import MemoryStore
from duvm.store.remote_store import RemoteStore
from duvm.store.repair import Repairer
from duvm.store.storage import PAGE_SIZE as PS
from duvm.store.storage import StorageError
from duvm.wire import auth
from duvm.wire import pageproto as pp
from memserver_raw import raw_conn

S1 = os.urandom(32)


def _sec(secret: bytes) -> auth.PeerSecurity:
    return auth.PeerSecurity(auth.Keyring((secret,)))


@pytest.fixture
async def secured():
    srv = MemServer(4 << 20, lease_s=60, lock=False, keyring=auth.Keyring((S1,)))
    srv.addr = await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


# --- auth: role labels and namespace binding --------------------------------------------------


async def test_a_reflected_server_proof_is_refused_as_the_clients_proof(
    secured: MemServer,
) -> None:
    """Catches the client's proof being computed with the same label as the server's (the
    role labels made equal, or the role left out): an attacker without the cluster secret
    could then send the memserver's own CHALLENGE proof back as its AUTH and be let in."""
    # the attacker knows the key id (public, it travels in clear) but not the secret
    ask, w = await raw_conn(secured.addr)
    hello = pp.Hello(1, "mallory", nonce=os.urandom(32), key_id=auth.key_id(S1), token=b"m" * 32)
    ch = await ask(hello)
    assert isinstance(ch, pp.Challenge) and ch.auth_required
    reply = await ask(pp.Auth(2, ch.proof))  # the reflection
    w.close()
    # outcome: refused, no namespace created, the failure counted
    assert isinstance(reply, pp.ErrorReply), f"a reflected proof was accepted: {reply!r}"
    assert reply.code == pp.ErrorCode.AUTH
    assert "mallory" not in secured.store.namespaces
    assert secured.counters["auth_failures"] == 1
    # mechanism: the proof the server wants from the client is not the one it sent itself,
    # and a client that knows the secret gets in on the same kind of handshake
    want = auth.proof(S1, "client", hello.nonce, ch.nonce, "mallory", b"m" * 32)
    assert want != ch.proof
    assert ch.proof == auth.proof(S1, "server", hello.nonce, ch.nonce, "mallory", b"m" * 32)
    ask, w = await raw_conn(secured.addr)
    hello2, st = auth.start_handshake("honest", _sec(S1), b"h" * 32)
    ch2 = await ask(hello2)
    assert isinstance(await ask(auth.answer_challenge(ch2, st, _sec(S1), "real")), pp.HelloReply)
    w.close()


async def test_a_proof_for_one_namespace_token_does_not_verify_for_another(
    secured: MemServer,
) -> None:
    """Catches the namespace token being left out of the proofs: a relay in the middle (no
    secret needed) could then rewrite a client's HELLO to another namespace token and both
    proofs would still verify, so the client's pages would go to a namespace owned by a token
    it never chose (and a client could switch namespace with a proof made for another)."""
    tok_a, tok_b = b"A" * 32, b"B" * 32
    # the honest client opens for namespace token A; the relay forwards the HELLO with token B
    hello_a, st_a = auth.start_handshake("victim/nbd0", _sec(S1), tok_a)
    hello_b = dataclasses.replace(hello_a, token=tok_b)
    ask, w = await raw_conn(secured.addr)
    ch = await ask(hello_b)
    assert isinstance(ch, pp.Challenge) and ch.auth_required
    # the client's check: the server proved the secret for namespace B, not for A
    with pytest.raises(auth.AuthError, match="failed to prove the cluster secret"):
        auth.answer_challenge(ch, st_a, _sec(S1), "relayed")
    # the server's check: the client's proof for namespace A, on a connection that asked for
    # namespace B, is refused and attaches nothing
    proof_a = auth.proof(S1, "client", hello_a.nonce, ch.nonce, "victim/nbd0", tok_a)
    reply = await ask(pp.Auth(2, proof_a))
    w.close()
    assert isinstance(reply, pp.ErrorReply), f"a proof for token A opened token B: {reply!r}"
    assert reply.code == pp.ErrorCode.AUTH
    assert "victim/nbd0" not in secured.store.namespaces
    assert secured.counters["auth_failures"] == 1
    # mechanism: the proofs differ only by the token, and the proof for B does open B
    assert proof_a != auth.proof(S1, "client", hello_a.nonce, ch.nonce, "victim/nbd0", tok_b)
    ask, w = await raw_conn(secured.addr)
    hello_b2, st_b = auth.start_handshake("victim/nbd0", _sec(S1), tok_b)
    ch_b = await ask(hello_b2)
    assert isinstance(await ask(auth.answer_challenge(ch_b, st_b, _sec(S1), "real")), pp.HelloReply)
    w.close()
    assert secured.store.namespaces["victim/nbd0"].owner == auth.token_digest(tok_b)


async def test_status_is_refused_until_the_proof_is_checked(secured: MemServer) -> None:
    """Catches STATUS being answered once a HELLO has arrived rather than once AUTH verified
    (`Connection._dispatch` testing `_hello` instead of `authed`): the key id travels in clear,
    so anyone who saw one could send HELLO then STATUS and list every client's namespace
    and its size without ever proving the secret."""
    ask, w = await raw_conn(secured.addr)
    hello, st = auth.start_handshake("victim/nbd0", _sec(S1), b"v" * 32)
    ch = await ask(hello)
    assert isinstance(await ask(auth.answer_challenge(ch, st, _sec(S1), "real")), pp.HelloReply)
    assert "victim/nbd0" in secured.store.namespaces  # a namespace STATUS would name
    probes = {
        "before HELLO": [],
        "between HELLO and AUTH": [
            pp.Hello(1, "mallory", nonce=os.urandom(32), key_id=auth.key_id(S1), token=b"m" * 32)
        ],
    }
    for when, before in probes.items():
        ask2, w2 = await raw_conn(secured.addr)
        for msg in before:
            assert isinstance(await ask2(msg), pp.Challenge)
        reply = await ask2(pp.Status(7))
        assert isinstance(reply, pp.ErrorReply), f"STATUS {when} answered: {reply!r}"
        assert reply.code == pp.ErrorCode.AUTH and "victim" not in reply.message
        assert await ask2(pp.Status(8)) is None, f"the connection stayed open {when}"
        w2.close()
    assert "mallory" not in secured.store.namespaces
    # the authenticated connection still gets it: the refusal is about who asks
    status = await ask(pp.Status(9))
    assert isinstance(status, pp.StatusReply) and b"victim/nbd0" in status.json
    w.close()


# --- crypt_store: the page number is bound into the AAD ---------------------------------------


def _page(tag: bytes) -> bytes:
    return (tag * (PS // len(tag) + 1))[:PS]


async def test_swapping_two_pages_ciphertext_with_their_nonce_and_tag_is_eio() -> None:
    """Catches the page number being left out of the AES-GCM associated data: a memserver that
    answers page 0 with page 1's ciphertext would then pass the tag check as soon as the
    nonce/tag entries travel with it (here both are swapped, so nothing but the page number
    in the AAD can tell), and the read would return page 1's bytes for page 0."""
    inner = MemoryStore(8 * PS)
    cs = CryptStore(inner)
    a, b = _page(b"page zero;"), _page(b"page one!;")
    await cs.write(0, memoryview(a + b))
    ct = bytearray(2 * PS)
    await inner.read(0, memoryview(ct))
    # swap the ciphertexts below and, together with them, their nonce|tag entries
    await inner.write(0, memoryview(ct[PS:] + ct[:PS]))
    m0, m1 = bytes(cs._meta[:META]), bytes(cs._meta[META : 2 * META])
    cs._meta[: 2 * META] = m1 + m0
    for page, other in ((0, b), (1, a)):
        out = bytearray(PS)
        with pytest.raises(StorageError) as ei:
            await cs.read(page * PS, memoryview(out))
        assert ei.value.errno == errno.EIO and "failed authentication" in str(ei.value)
        assert bytes(out) != other and bytes(out) == bytes(PS)  # nothing unverified leaks
    assert cs.counters()["tag_failures"] == 2
    # mechanism: put both back and each page opens again (the swap alone made them fail)
    await inner.write(0, memoryview(ct))
    cs._meta[: 2 * META] = m0 + m1
    out = bytearray(2 * PS)
    await cs.read(0, memoryview(out))
    assert bytes(out) == a + b


# --- repair: the copy and writes to the slab under repair -------------------------------------

SLAB = 64  # pages: one slab, copied in one chunk (repair.CHUNK_PAGES)
HOT = 5  # the page written while the copy runs


async def _degraded_store(memserver_pool, client_id: str):
    """A 1-slab RemoteStore with R=2 over 3 memservers, written with `old`; then one of the
    slab's replicas is dropped and its memserver killed. Returns (servers, store, old,
    survivor, spare): the slab's surviving replica and the only peer a repair can copy to."""
    servers, addrs = await memserver_pool(3, 4 << 20)
    store = await RemoteStore.open(
        addrs, SLAB * PS, client_id, slab_pages=SLAB, replicas=2, repair=False, seed=7
    )
    old = os.urandom(SLAB * PS)
    await store.write(0, memoryview(old))
    survivor, dead = store.table.sets[0]
    spare = ({0, 1, 2} - {survivor, dead}).pop()
    assert store.replication.drop_replica(0, dead, "test: its memserver died")
    await servers[dead].close()
    return servers, store, old, survivor, spare


def _assert_replicas_hold(
    servers: list[MemServer], replicas: tuple[int, ...], cid: str, want: bytes
) -> None:
    """Every page of the slab on each of `replicas` is the last written."""
    for i in replicas:
        got = _replica_bytes(servers[i], cid)
        stale = [
            p for p in range(SLAB) if got[p * PS : (p + 1) * PS] != want[p * PS : (p + 1) * PS]
        ]
        assert not stale, f"replica {i} holds other bytes than the last written at pages {stale}"


def _replica_bytes(srv: MemServer, client_id: str) -> bytes:
    """The slab as this memserver holds it (straight from its page store)."""
    ps = srv.store
    return ps.load(ps.namespaces[client_id], tuple(range(SLAB)))


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


async def test_a_write_during_a_repair_chunk_copy_reaches_every_replica(memserver_pool) -> None:
    """Catches a chunk copied without the per-slab lock, or a write to a slab under repair
    that does not take it: the copier's LOAD then reads the old bytes, the write stores new
    bytes on the survivor and the target, and the copier's STORE lands afterwards and puts
    the old bytes back on the new replica, which then disagrees with the survivor."""
    cid = "t:repair-lock"
    servers, store, old, survivor, spare = await _degraded_store(memserver_pool, cid)
    loaded, go = asyncio.Event(), asyncio.Event()
    try:
        real_load = store.reads.load_verified

        async def copier_load(slab: int, first: int, count: int, out: memoryview) -> None:
            await real_load(slab, first, count, out)
            if not loaded.is_set():  # the copy's first chunk: hold it between LOAD and STORE
                loaded.set()
                await go.wait()

        rep = Repairer(store.replication, copier_load)
        repair = asyncio.ensure_future(rep.repair_all())
        await asyncio.wait_for(loaded.wait(), 10)
        chunk = store.replication.repairs[0]
        assert chunk.target == spare
        new = os.urandom(PS)
        write = asyncio.ensure_future(store.write(HOT * PS, memoryview(new)))
        # until the write has either finished or queued behind the copier's lock (asyncio.Lock
        # keeps its queued waiters in `_waiters`)
        await _until(lambda: write.done() or bool(chunk.lock._waiters))
        write_done_during_copy = write.done()
        go.set()
        assert await asyncio.wait_for(repair, 10) == 1, rep.last_error
        await asyncio.wait_for(write, 10)
        # outcome: both replicas hold the latest bytes of every page
        want = old[: HOT * PS] + new + old[(HOT + 1) * PS :]
        assert sorted(store.table.sets[0]) == sorted([survivor, spare])
        _assert_replicas_hold(servers, (survivor, spare), cid, want)
        # mechanism: the write waited for the chunk copy (it did not run inside it)
        assert not write_done_during_copy
        assert rep.counters.repairs_done == 1 and rep.counters.repair_pages_copied == SLAB
        out = bytearray(SLAB * PS)
        await store.read(0, memoryview(out))
        assert out == want and store.counters()["checksum_failures"] == 0
    finally:
        go.set()
        await store.close()


async def test_a_repair_copy_waits_for_a_write_already_in_flight(memserver_pool) -> None:
    """Catches a repair that starts copying while a write that began before the copy was
    registered is still in flight: that write goes to the old replica set only, so the copy
    reads the old bytes and the new replica keeps them after the write lands on the survivor."""
    cid = "t:repair-inflight"
    servers, store, old, survivor, spare = await _degraded_store(memserver_pool, cid)
    sending, release = asyncio.Event(), asyncio.Event()
    try:
        c = store.clients[survivor]
        real_store_batch = c.store_batch

        async def held_store_batch(keys, data):
            if not sending.is_set():  # the write's STORE waits before it leaves
                sending.set()
                await release.wait()
            return await real_store_batch(keys, data)

        c.store_batch = held_store_batch
        copy_loads: list[int] = []
        real_load = store.reads.load_verified

        async def copier_load(slab: int, first: int, count: int, out: memoryview) -> None:
            copy_loads.append(first)
            await real_load(slab, first, count, out)

        new = os.urandom(PS)
        write = asyncio.ensure_future(store.write(HOT * PS, memoryview(new)))
        await asyncio.wait_for(sending.wait(), 10)
        assert store.table.inflight[0] == 1  # the write is in flight, the slab not in repair
        rep = Repairer(store.replication, copier_load)
        repair = asyncio.ensure_future(rep.repair_all())
        await _until(
            lambda: 0 in store.replication.repairs or repair.done()
        )  # the copy is registered
        # give a copy that does not wait every chance to read (it needs a few round trips);
        # one that waits reads nothing until the write is released below
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_until(lambda: bool(copy_loads) or repair.done()), 1.0)
        read_while_in_flight = bool(copy_loads) or repair.done()
        release.set()
        await asyncio.wait_for(write, 10)
        assert await asyncio.wait_for(repair, 10) == 1, rep.last_error
        # outcome: both replicas hold the latest bytes of every page
        want = old[: HOT * PS] + new + old[(HOT + 1) * PS :]
        assert sorted(store.table.sets[0]) == sorted([survivor, spare])
        _assert_replicas_hold(servers, (survivor, spare), cid, want)
        # mechanism: the copy read nothing until the write was through
        assert not read_while_in_flight and copy_loads == [0]
        assert rep.counters.repairs_done == 1 and rep.counters.repair_pages_copied == SLAB
    finally:
        release.set()
        await store.close()
