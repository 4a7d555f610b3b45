"""The memserver's RDMA service on a fake verbs device (duvm.testing.fake_verbs, standing in
for the RDMA NIC this machine lacks), which refuses what a NIC refuses: the rules that only a
real device would otherwise exercise (an expired ticket, a region one page too long, regions
deregistered before their slots go back, rkeys outliving RELEASE or the connection), and that
no namespace reads another's old bytes by RDMA READ. The service runs its real code on a real
event loop; the real device path runs in the QEMU guest (test_rdma_qemu.py)."""

from __future__ import annotations

import asyncio
import ctypes
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from duvm.memserver.pagestore import Namespace, PageStore
from duvm.memserver.rdma_service import TICKET_TTL_S, RdmaService
from duvm.memserver.server import MemServer
from duvm.rdma import verbs
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import PageServerError
from duvm.testing.fake_verbs import FakeClient, FakeVerbs, Region, RemoteAccessError
from duvm.wire import pageproto as pp

PS = pp.PAGE_SIZE
CP = 16  # chunk pages in these tests
SECRET = b"SECRET-A" * (PS // 8)


class Clock:
    """Monotonic seconds that move only when a test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for `cond` (events cross a pipe the loop watches): generous, for loaded CI."""
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"gave up waiting for {what}") from None


@dataclass
class Rig:
    store: PageStore
    nic: FakeVerbs
    svc: RdmaService
    clock: Clock
    deregistered: list[tuple[Region, int]]  # (region, the arena's free slots at that moment)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    store = PageStore(256, lock=False)
    seen: list[tuple[Region, int]] = []
    nic = FakeVerbs(on_deregister=lambda r: seen.append((r, store.arena.free_slots)))
    clock = Clock()
    svc = RdmaService(store, nic, clock)
    svc.start("127.0.0.1", 4791)
    try:
        yield Rig(store, nic, svc, clock, seen)
    finally:
        svc.close()
        store.close()


async def open_session(
    rig: Rig, client_id: str, pages: int
) -> tuple[object, Namespace, FakeClient]:
    """What a client does: RDMA_OPEN on its TCP connection (`owner`), RESERVE, connect with
    the ticket; returns once the session is established."""
    ns, _ = rig.store.attach(client_id)
    owner = object()
    ticket = rig.svc.open(owner, ns, CP, 1).ticket
    rig.store.reserve(ns, pages)
    rig.svc.sync_regions(ns)  # as the connection's RESERVE does
    sessions = rig.svc.status()["sessions"]
    client = rig.nic.connect(ticket)
    await until(lambda: rig.svc.status()["sessions"] == sessions + 1, "the session")
    assert client.state == "accepted"
    return owner, ns, client


def _members(proto: type) -> tuple[list[str], list[str]]:
    """A protocol's (methods, data members) by name."""
    methods = [
        n
        for n, v in vars(proto).items()
        if not n.startswith("_") and callable(v) and not isinstance(v, property)
    ]
    data = [n for n, v in vars(proto).items() if isinstance(v, property)]
    data += [n for n in proto.__annotations__ if not n.startswith("_")]
    return methods, data


def _params(f: object) -> list[tuple[str, object, object]]:
    ps = inspect.signature(f).parameters.values()  # type: ignore[arg-type]
    return [(p.name, p.kind, p.default) for p in ps]


def test_the_fake_device_has_the_compiled_modules_names_and_signatures() -> None:
    """Catches the fake drifting from `duvm.rdma._verbs` (a renamed method, another
    parameter, another event number): the service would pass against the fake and fail on a
    real device."""
    real = verbs.load()
    if real is None:
        pytest.skip(f"the verbs module is {verbs.state()}")
    nic = FakeVerbs()
    channel = nic.EventChannel()
    cm = nic.CmId.create(channel)
    cm.listen("127.0.0.1", 4791)
    domain = cm.create_domain(4, False)
    buf = ctypes.create_string_buffer(PS)
    region = domain.register(ctypes.addressof(buf), PS, True)
    pairs = [
        (verbs.EventChannelApi, real.EventChannel, channel),
        (verbs.CmIdApi, real.CmId, cm),
        (verbs.DomainApi, real.Domain, domain),
        (verbs.RegionApi, real.Region, region),
    ]
    try:
        for proto, real_cls, fake in pairs:
            methods, data = _members(proto)
            for name in data:
                assert hasattr(real_cls, name) and hasattr(fake, name), (proto, name)
            for name in methods:
                want = _params(getattr(real_cls, name))
                assert _params(getattr(type(fake), name)) == want, (proto, name)
        methods, data = _members(verbs.VerbsApi)
        for name in data:
            if name not in ("EventChannel", "CmId"):
                assert getattr(nic, name) == getattr(real, name), name
        assert _params(nic.event_name) == _params(real.event_name)
        for event in range(16):
            assert nic.event_name(event) == real.event_name(event)
        assert _params(nic.CmId.create) == _params(real.CmId.create)
    finally:
        cm.close()
        channel.close()


async def test_the_fake_nic_refuses_what_a_nic_refuses() -> None:
    """The fake itself: a READ or WRITE reaches memory only inside a live region of its own
    connection's domain, with that region's rkey, while the connection is up."""
    nic = FakeVerbs()
    channel = nic.EventChannel()
    listener = nic.CmId.create(channel)
    listener.listen("127.0.0.1", 4791)
    buf = ctypes.create_string_buffer(b"abcdefgh" * 4)
    addr = ctypes.addressof(buf)
    ends = []
    for ticket in (b"one", b"two"):
        client = nic.connect(ticket)
        kind, _, cm, data = channel.get_event()
        assert (kind, data, cm.listener) == (nic.CONNECT_REQUEST, ticket, listener)
        domain = cm.create_domain(4, False)
        ends.append((client, cm, domain.register(addr + 8, 16, True)))
        cm.accept(16)
        assert channel.get_event()[:3] == (nic.ESTABLISHED, 0, cm)
    (c1, cm1, r1), (c2, _, r2) = ends
    assert c1.read(addr + 8, 16, r1.rkey) == b"abcdefgh" * 2
    c1.write(addr + 12, b"XY", r1.rkey)
    assert buf.raw[8:18] == b"abcdXYgh" + b"ab"
    for bad in (
        lambda: c1.read(addr + 8, 17, r1.rkey),  # one byte past the region
        lambda: c1.read(addr + 7, 2, r1.rkey),  # one byte before it
        lambda: c1.read(addr + 8, 8, r2.rkey),  # another connection's key
        lambda: c1.write(addr + 24, b"!", r1.rkey),
    ):
        with pytest.raises(RemoteAccessError):
            bad()
    r1.close()
    with pytest.raises(RemoteAccessError):
        c1.read(addr + 8, 8, r1.rkey)  # deregistered
    assert c2.read(addr + 8, 8, r2.rkey) == b"abcdXYgh"
    c2.disconnect()
    assert channel.get_event()[0] == nic.DISCONNECTED
    with pytest.raises(RemoteAccessError):
        c2.read(addr + 8, 8, r2.rkey)  # the queue pair is down
    cm1.close()
    assert channel.get_event() is None
    assert buf.raw[:32] == b"abcdefghabcdXYghabcdefghabcdefgh"  # the refused WRITE: nothing
    for cm in (ends[1][1], listener):
        cm.close()
    channel.close()
    assert channel.fd == -1


async def test_an_expired_ticket_is_refused(rig: Rig) -> None:
    """Catches an RDMA connect request accepted with an expired ticket (the expiry not
    checked, or set in the wrong unit): a ticket leaked in logs or memory would open the
    namespace's memory to whoever holds it, long after it was handed out."""
    ns, _ = rig.store.attach("a")
    owner = object()
    ticket = rig.svc.open(owner, ns, CP, 1).ticket
    rig.store.reserve(ns, CP)
    rig.clock.now += TICKET_TTL_S + 0.5
    late = rig.nic.connect(ticket)
    await until(lambda: late.state != "requested", "the answer")
    assert late.state == "rejected"
    assert rig.svc.status()["rdma_rejected"] == 1 and rig.svc.status()["sessions"] == 0
    ticket = rig.svc.open(owner, ns, CP, 2).ticket
    rig.clock.now += TICKET_TTL_S - 0.5  # still valid
    client = rig.nic.connect(ticket)
    await until(lambda: rig.svc.status()["sessions"] == 1, "the session")
    assert client.state == "accepted"
    again = rig.nic.connect(ticket)  # a ticket is good for one connect
    await until(lambda: again.state != "requested", "the answer")
    assert again.state == "rejected" and rig.svc.status()["rdma_rejected"] == 2


async def test_a_region_ends_where_its_namespaces_slots_end(rig: Rig) -> None:
    """Catches a region registered longer than its extent (one page too long): the client's
    rkey would reach the next slot, here another namespace's page."""
    owner, ns, client = await open_session(rig, "a", CP)
    other, _ = rig.store.attach("b")
    rig.store.reserve(other, 4)
    rig.store.store(other, (0, 1, 2, 3), memoryview(SECRET * 4))
    assert ns.extents == [(0, CP)] and set(other.pages.values()) == {CP, CP + 1, CP + 2, CP + 3}
    m = rig.svc.map(owner, ns, 0, 1)
    assert (m.address, m.pages) == (rig.store.arena.address, CP)
    last = m.address + (CP - 1) * PS
    client.write(last, b"L" * PS, m.rkey)
    assert client.read(last, PS, m.rkey) == b"L" * PS  # its own last page
    for addr, length in ((m.address + CP * PS, PS), (last, 2 * PS), (m.address - PS, PS)):
        with pytest.raises(RemoteAccessError):
            client.read(addr, length, m.rkey)
    with pytest.raises(RemoteAccessError):
        client.write(m.address + CP * PS, bytes(PS), m.rkey)
    assert rig.store.load(other, (0,)) == SECRET


async def test_regions_are_deregistered_before_a_release_returns_their_slots(rig: Rig) -> None:
    """Catches RELEASE (or a lease expiry) returning a namespace's slots to the arena before
    its regions are deregistered: meanwhile the NIC still honours the client's rkey on slots
    another namespace may be given. Each region must go while the arena still holds none of
    them free, and the rkey is refused after."""
    owner, ns, client = await open_session(rig, "a", 3 * CP)
    m = rig.svc.map(owner, ns, 0, 1)
    free_before, regions = rig.store.arena.free_slots, len(ns.extents)
    assert client.read(m.address, PS, m.rkey) == bytes(PS)
    assert rig.store.release(ns) == CP  # what RELEASE and a lease expiry both run
    assert regions and [free for _, free in rig.deregistered] == [free_before] * regions
    assert rig.store.arena.free_slots == free_before + 3 * CP
    with pytest.raises(RemoteAccessError):
        client.read(m.address, PS, m.rkey)


async def test_released_bytes_never_reach_an_rdma_read(rig: Rig) -> None:
    """Catches the slots an RDMA reservation takes handed over uncleared: its whole extents
    are registered at RESERVE, so an RDMA READ, even of a chunk not mapped yet, would return
    what another namespace (by TCP or by RDMA) left there."""
    tcp, _ = rig.store.attach("t")
    rig.store.reserve(tcp, 256)
    rig.store.store(tcp, tuple(range(256)), memoryview(SECRET * 256))
    rig.store.release(tcp)
    owner, ns, client = await open_session(rig, "r", 4 * CP)
    m = rig.svc.map(owner, ns, 0, 1)  # chunks 1..3 stay unmapped, registered all the same
    assert ns.extents == [(0, 4 * CP)] and len(ns.spare) == 3
    assert client.read(m.address, 4 * CP * PS, m.rkey) == bytes(4 * CP * PS)
    client.write(m.address, SECRET * 4 * CP, m.rkey)  # its own pages, then released
    rig.store.release(ns)
    owner2, ns2, client2 = await open_session(rig, "r2", 8 * CP)
    m2 = rig.svc.map(owner2, ns2, 0, 1)
    assert ns2.extents == [(0, 8 * CP)]  # r's slots and t's
    assert client2.read(m2.address, 8 * CP * PS, m2.rkey) == bytes(8 * CP * PS)


async def test_after_release_or_the_connection_closing_the_rkey_is_refused() -> None:
    """Through a real memserver on loopback (its connection's RELEASE and close, the fake
    device for rdma-cm). Catches an rkey that outlives the RELEASE of its namespace or the
    TCP connection it belongs to, and a RELEASE that returns the slots before deregistering
    (the arena's free slots are read as each region goes)."""
    seen: list[int] = []
    srv = MemServer(256 * PS, lease_s=60, lock=False)
    nic = FakeVerbs(on_deregister=lambda r: seen.append(srv.store.arena.free_slots))
    addr = await srv.start()
    assert srv.start_rdma(*addr, required=True, load_verbs=lambda: nic)
    clients = [MemClient(*addr, cid) for cid in ("a", "b")]
    try:
        ends = []
        for i, c in enumerate(clients):
            await c.connect()
            ticket = (await c._request(pp.RdmaOpen(0, CP))).ticket
            await c.reserve(2 * CP)
            end = nic.connect(ticket)
            await until(lambda i=i: srv.rdma.status()["sessions"] == i + 1, "the session")
            m = await c._request(pp.RdmaMap(0, 1))
            end.write(m.address, SECRET, m.rkey)
            assert bytes(await c.load([CP])) == SECRET  # the same slot, read by TCP
            ends.append((end, m))
        (end_a, m_a), (end_b, m_b) = ends
        free_before = srv.store.arena.free_slots
        assert await clients[0].release() == CP
        assert seen == [free_before]
        with pytest.raises(RemoteAccessError):
            end_a.read(m_a.address, PS, m_a.rkey)
        assert end_b.read(m_b.address, PS, m_b.rkey) == SECRET
        await clients[1].close()
        await until(lambda: srv.rdma.status()["sessions"] == 1, "b's session to close")
        with pytest.raises(RemoteAccessError):
            end_b.read(m_b.address, PS, m_b.rkey)
        assert end_b.state == "disconnected"
    finally:
        for c in clients:
            await c.close()
        await srv.close()


@pytest.mark.parametrize("path", ["reference", "compiled"])
async def test_released_bytes_never_reach_a_new_namespace_by_load(pick_path, path: str) -> None:
    """Through a real memserver and client on loopback, both memserver loops. Catches the
    slots of an RDMA reservation handed over uncleared (a mapped chunk's keys count as
    stored, so a LOAD of a key never written returned another namespace's page), and a TCP
    namespace answering a key never stored with a slot's old bytes instead of NOT_FOUND."""
    pick_path(path, "duvm.memserver._hotloop")
    srv = MemServer(64 * PS, lease_s=60, lock=False)
    addr = await srv.start()
    assert srv.start_rdma(*addr, required=True, load_verbs=FakeVerbs)
    a, r, t = (MemClient(*addr, cid) for cid in ("a", "r", "t"))
    try:
        await a.connect()
        await a.reserve(64)
        await a.store(range(64), SECRET * 64)
        assert await a.free(range(0, 64, 2)) == 32  # half by FREE, the hot path
        assert await a.release() == 32
        await r.connect()
        await r._request(pp.RdmaOpen(0, CP))
        await r.reserve(2 * CP)
        await r.store([3], b"r" * PS)  # maps chunk 0: its 16 keys count as stored
        assert bytes(await r.load(range(CP))) == bytes(3 * PS) + b"r" * PS + bytes(12 * PS)
        await t.connect()
        await t.reserve(32)
        await t.store([5], b"t" * PS)
        assert bytes(await t.load([5])) == b"t" * PS
        for keys in ([0], [4, 5], list(range(16)), list(range(32))):
            with pytest.raises(PageServerError) as ei:
                await t.load(keys)
            assert ei.value.code == pp.ErrorCode.NOT_FOUND
        assert (srv.open_connections()[0]._hot is not None) == (path == "compiled")
    finally:
        for c in (a, r, t):
            await c.close()
        await srv.close()
