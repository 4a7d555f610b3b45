"""The memserver's side of the RDMA transport that runs without an RDMA device: RDMA namespaces
in the page store (slots held as runs of whole chunks, mapped by chunk, never returned page by
page), the arena's runs, the protocol's RDMA_OPEN and RDMA_MAP on a real memserver without an
RDMA listener, and a memory client's choice of transport (`auto` falls back to TCP and says
why, `rdma` refuses to). The RDMA service on a fake device is test_rdma_service.py; the verbs
path itself runs in the QEMU guest (test_rdma_qemu.py).
"""

from __future__ import annotations

import asyncio

import pytest
from duvm.memserver.arena import Arena, ArenaFull
from duvm.memserver.pagestore import Namespace, PageStore, Refused
from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.wire import pageproto as pp
from hypothesis import given, settings
from hypothesis import strategies as st

PS = pp.PAGE_SIZE
CP = 16  # chunk pages in these tests


def _slots_of(store: PageStore, client_id: str) -> set[int]:
    ns = store.namespaces[client_id]
    if ns.chunk_pages:
        return {s for first, n in ns.extents for s in range(first, first + n)}
    return set(ns.pages.values())


def test_an_rdma_namespace_holds_whole_chunks_in_runs_and_maps_them() -> None:
    store = PageStore(256, lock=False)
    ns, _ = store.attach("a")
    store.open_rdma(ns, CP)
    assert store.reserve(ns, 20) == 0
    assert (ns.reserved, store.reserved_total) == (32, 32)  # two chunks of 16
    assert ns.extents == [(0, 32)]  # one run: one region for the NIC
    first = store.map_chunk(ns, 7)
    assert store.map_chunk(ns, 7) == first  # idempotent: a reconnect finds the same slots
    assert {ns.pages[k] for k in range(7 * CP, 8 * CP)} == set(range(first, first + CP))
    store.map_chunk(ns, 0)
    with pytest.raises(Refused) as ei:
        store.map_chunk(ns, 3)  # a third chunk is beyond the reservation
    assert ei.value.code == pp.ErrorCode.NO_SPACE
    assert store.arena.used_slots == 32


def test_tcp_requests_on_an_rdma_namespace_reach_the_same_slots_and_free_returns_none() -> None:
    """Catches FREE returning an RDMA namespace's slot to the arena page by page: the slot
    would go to another namespace while this client can still write it by address."""
    store = PageStore(64, lock=False)
    ns, _ = store.attach("a")
    store.open_rdma(ns, CP)
    store.reserve(ns, CP)
    data = bytes(range(256)) * 16
    store.store(ns, (5,), memoryview(data))  # maps chunk 0 on the way
    assert ns.chunks == {0: ns.pages[5] - 5}
    assert store.load(ns, (5,)) == data
    free_before = store.arena.free_slots
    assert store.free(ns, (5, 6, 999)) == 2  # keys present, counted
    assert store.arena.free_slots == free_before  # nothing went back to the arena
    assert store.load(ns, (5,)) == data  # still there: FREE is a no-op for RDMA
    other, _ = store.attach("b")
    store.reserve(other, 48)
    store.store(other, tuple(range(48)), memoryview(bytes(48 * PS)))
    assert not _slots_of(store, "a") & set(other.pages.values())
    assert store.release(ns) == CP
    assert (store.arena.free_slots, store.reserved_total) == (16, 48)


def test_a_new_rdma_namespace_never_loads_the_bytes_of_released_slots() -> None:
    """Catches the runs an RDMA reservation takes handed over uncleared: mapping a chunk
    counts its keys as stored, so a LOAD of one never written returned what another namespace
    (TCP or RDMA) left in the slot."""
    secret = b"SECRET-A" * (PS // 8)
    store = PageStore(64, lock=False)
    a, _ = store.attach("client-a")
    store.reserve(a, 64)
    store.store(a, tuple(range(64)), memoryview(secret * 64))
    store.release(a)
    b, _ = store.attach("client-b")
    store.open_rdma(b, CP)
    store.reserve(b, 2 * CP)
    store.map_chunk(b, 0)
    assert store.load(b, tuple(range(CP))) == bytes(CP * PS)
    store.store(b, tuple(range(CP, 2 * CP)), memoryview(secret * CP))  # its own, chunk 1
    store.release(b)
    c, _ = store.attach("client-c")
    store.open_rdma(c, CP)
    store.reserve(c, 4 * CP)
    for chunk in range(4):
        store.map_chunk(c, chunk)
    assert store.load(c, tuple(range(4 * CP))) == bytes(4 * CP * PS)


def test_a_refused_store_on_an_rdma_namespace_maps_nothing() -> None:
    """Catches a STORE refused for lack of room on its second new chunk that leaves the first
    one mapped (a refusal must change nothing): its keys would count as stored."""
    store = PageStore(64, lock=False)
    ns, _ = store.attach("a")
    store.open_rdma(ns, CP)
    store.reserve(ns, CP)
    keys = (0, 1, CP, CP + 1)  # chunks 0 and 1: only one fits
    with pytest.raises(Refused) as ei:
        store.store(ns, keys, memoryview(bytes(4 * PS)))
    assert ei.value.code == pp.ErrorCode.NO_SPACE
    assert (ns.chunks, ns.pages, len(ns.spare)) == ({}, {}, 1)
    assert store.counters["pages_stored"] == 0


async def test_a_lease_expiry_runs_the_release_hooks_before_freeing_slots() -> None:
    """Catches a release path (here the lease running out) that returns slots to the arena
    before the release hooks ran: the RDMA service drops its regions in that hook."""
    store = PageStore(64, lease_s=0.01, lock=False)
    seen: list[tuple[str, int]] = []

    def hook(ns: Namespace) -> None:
        seen.append((ns.client_id, store.arena.free_slots))

    store.add_release_hook(hook)
    ns, _ = store.attach("a")
    store.open_rdma(ns, CP)
    store.reserve(ns, 2 * CP)
    store.detach(ns, asyncio.get_running_loop())
    for _ in range(200):
        if "a" not in store.namespaces:
            break
        await asyncio.sleep(0.005)
    assert seen == [("a", 64 - 2 * CP)] and store.arena.free_slots == 64
    store.remove_release_hook(hook)
    store.remove_release_hook(hook)  # gone already: nothing happens
    other, _ = store.attach("b")
    store.release(other)
    assert len(seen) == 1
    store.close()


def test_rdma_namespaces_never_shrink_and_refuse_mixed_use() -> None:
    store = PageStore(64, lock=False)
    ns, _ = store.attach("a")
    store.open_rdma(ns, CP)
    store.reserve(ns, 40)
    store.reserve(ns, 5)  # a client may still address what it holds
    assert ns.reserved == 48
    with pytest.raises(Refused) as ei:
        store.open_rdma(ns, 8)
    assert ei.value.code == pp.ErrorCode.INVALID
    tcp, _ = store.attach("b")
    store.reserve(tcp, 4)
    with pytest.raises(Refused) as ei:
        store.open_rdma(tcp, CP)  # its reservation was made for TCP slots
    assert ei.value.code == pp.ErrorCode.BUSY
    with pytest.raises(Refused) as ei:
        store.reserve(ns, 100)
    assert ei.value.code == pp.ErrorCode.NO_SPACE and ns.reserved == 48


def test_arena_runs_take_the_longest_free_runs_and_refuse_when_too_fragmented() -> None:
    arena = Arena(64, lock=False)
    taken = arena.alloc_many(64)
    for s in [*range(0, 8), *range(16, 40), *range(50, 54)]:
        arena.free(s)
    assert arena.alloc_runs(24, 8) == [(16, 24)]  # longest first
    with pytest.raises(ArenaFull, match="fragmented"):
        arena.alloc_runs(16, 8)  # 8 + 4 free in runs: only one chunk of 8 fits
    assert arena.free_slots == 12  # a refusal takes nothing
    assert arena.alloc_runs(8, 8) == [(0, 8)]
    arena.memory[0:PS] = b"x" * PS
    arena.zero(0, 8)
    assert arena.memory[0 : 8 * PS] == bytes(8 * PS)
    for first, count in ((-1, 1), (60, 5)):
        with pytest.raises(ValueError, match="outside"):
            arena.zero(first, count)  # never a memset past the mapping
    arena.free_run(16, 24)
    assert sorted(arena.alloc_many(24)) == list(range(16, 40))  # lowest first again
    assert len(taken) == 64


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["reserve", "store", "free", "release", "map"]),
            st.sampled_from(["r1", "r2", "t1"]),
            st.integers(0, 5),
        ),
        max_size=40,
    )
)
def test_no_slot_an_rdma_client_may_address_is_ever_another_namespaces(ops: list) -> None:
    """Safety rule. Catches any path (FREE, a TCP STORE that allocates, a release that frees
    too early, a run handed out twice) that gives a slot inside an RDMA namespace's regions to
    another namespace: its client could then read or overwrite that namespace's pages."""
    store = PageStore(160, lock=False)
    for cid in ("r1", "r2", "t1"):
        ns, _ = store.attach(cid)
        if cid.startswith("r"):
            store.open_rdma(ns, CP)
    for op, cid, n in ops:
        ns = store.namespaces[cid]
        try:
            if op == "reserve":
                store.reserve(ns, n * 10)
            elif op == "store":  # keys n..n+2 of chunk 0, or of chunk 1 for n = 5
                keys = tuple(range(n * 3, n * 3 + 3))
                store.store(ns, keys, memoryview(bytes(3 * PS)))
            elif op == "free":
                store.free(ns, tuple(range(n * 3, n * 3 + 3)))
            elif op == "release":
                store.release(ns)
            elif op == "map" and ns.chunk_pages:
                store.map_chunk(ns, n)
        except Refused:
            pass
        held = {c: _slots_of(store, c) for c in ("r1", "r2", "t1")}
        assert not held["r1"] & held["r2"]
        assert not (held["r1"] | held["r2"]) & held["t1"]
        assert not (held["r1"] | held["r2"] | held["t1"]) & set(store.arena._free)
        for c in ("r1", "r2"):
            assert set(store.namespaces[c].pages.values()) <= held[c]


@pytest.fixture
async def server():
    srv = MemServer(4 << 20, lease_s=60, lock=False)
    srv.addr = await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


async def test_a_memserver_without_rdma_refuses_rdma_open_and_map(server: MemServer) -> None:
    c = MemClient(*server.addr, "a")
    await c.connect()
    for msg in (pp.RdmaOpen(0, 256), pp.RdmaMap(0, 0)):
        with pytest.raises(PageServerError, match="does not serve RDMA") as ei:
            await c._request(msg)
        assert ei.value.code == pp.ErrorCode.INVALID
    assert c.connected  # a refusal, not a protocol error: the connection stays
    st_ = await c.status()
    assert st_["rdma"] == {"listening": False}
    assert st_["namespaces"][0]["rdma_chunk_pages"] is None
    await c.close()


async def test_auto_falls_back_to_tcp_and_says_why_while_rdma_refuses(
    server: MemServer, caplog
) -> None:
    auto = MemClient(*server.addr, "auto", transport="auto")
    await auto.connect()
    assert auto.transport_in_use == "tcp"
    assert auto.rdma_error
    assert "not" in auto.rdma_error  # not built, or this memserver does not serve RDMA
    assert any("pages move by TCP, not RDMA" in r.getMessage() for r in caplog.records)
    await auto.reserve(4)
    await auto.store([1], bytes(PS))
    assert bytes(await auto.load([1])) == bytes(PS)
    await auto.close()
    strict = MemClient(*server.addr, "strict", transport="rdma")
    with pytest.raises(MemserverUnreachable, match="no RDMA connection"):
        await strict.connect()
    assert strict.transport_in_use is None
    with pytest.raises(ValueError, match="transport"):
        MemClient(*server.addr, "x", transport="udp")


async def test_an_rdma_namespace_over_tcp_takes_the_reference_path(server: MemServer) -> None:
    """Catches the compiled STORE/FREE loop serving an RDMA namespace: it allocates and frees
    single arena slots, outside the namespace's regions."""
    c = MemClient(*server.addr, "a")
    await c.connect()
    ns = server.store.namespaces["a"]
    server.store.open_rdma(ns, CP)  # what RDMA_OPEN does on a memserver with a listener
    await c.reserve(CP)
    await c.store(range(3), bytes(3 * PS))
    used = server.store.arena.used_slots
    assert await c.free([0, 1]) == 2
    assert server.store.arena.used_slots == used == CP
    assert _slots_of(server.store, "a") == set(range(CP))
    await c.close()
