"""duvm.Pool, the explicit API, against real memservers on loopback."""

from __future__ import annotations

import errno
import os

import duvm
import pytest
from duvm.memserver.server import MemServer
from duvm.store.memserver_status import query_status
from duvm.store.pool import GROUP_PAGES, PoolError, PoolFull, PoolKeyError
from duvm.wire import auth

PS = 4096


@pytest.fixture
async def addrs():
    srvs = [MemServer(4 << 20, lock=False) for _ in range(2)]
    out = [await s.start() for s in srvs]
    try:
        yield out
    finally:
        for s in srvs:
            await s.close()


async def test_readme_example_round_trip(addrs) -> None:
    page = os.urandom(PS)
    three = os.urandom(3 * PS)
    async with duvm.Pool(addrs, "myapp:cache:1", pages=1024) as pool:
        await pool.store(7, page)
        await pool.store_many([1, 2, 3], three)
        assert await pool.load(7) == page
        assert await pool.load_many([3, 1, 2]) == three[2 * PS :] + three[: 2 * PS]
        assert await pool.free([1, 2, 99]) == 2
        with pytest.raises(PoolKeyError) as ei:
            await pool.load(1)
        assert ei.value.errno == errno.ENOENT and isinstance(ei.value, KeyError)
        st = await pool.status()
        assert sum(s["used_pages"] for s in st) == 2
        assert [s["reserved_pages"] for s in st] == [512, 512]
    st = [await query_status(*a) for a in addrs]
    assert [(s["used_pages"], s["reserved_pages"]) for s in st] == [(0, 0), (0, 0)]


async def test_batches_spanning_memservers_keep_order(addrs) -> None:
    keys = [0, GROUP_PAGES, 1, GROUP_PAGES + 1, 5 * GROUP_PAGES + 3]  # both memservers
    data = os.urandom(len(keys) * PS)
    async with duvm.Pool(addrs, "app:span:1", pages=64) as pool:
        await pool.store_many(keys, data)
        used = [s["used_pages"] for s in await pool.status()]
        assert used == [2, 3]
        out = bytearray(len(keys) * PS)
        assert await pool.load_many(keys, out) is None
        assert out == data


async def test_pool_full_is_refused_not_queued(addrs) -> None:
    async with duvm.Pool(addrs[:1], "app:full:1", pages=4) as pool:
        await pool.store_many(range(4), bytes(4 * PS))
        with pytest.raises(PoolFull) as ei:
            await pool.store(4, bytes(PS))
        assert ei.value.errno == errno.ENOSPC
        await pool.store(0, b"z" * PS)  # replacing a stored page needs no room
        assert await pool.load(0) == b"z" * PS


async def test_close_without_release_keeps_pages_for_a_restart(addrs) -> None:
    pool = duvm.Pool(addrs, "app:keep:1", pages=16)
    await pool.open()
    await pool.store(3, b"k" * PS)
    await pool.close(release=False)
    async with duvm.Pool(addrs, "app:keep:1", pages=16) as again:
        assert await again.load(3) == b"k" * PS


async def test_open_fails_clearly(addrs) -> None:
    with pytest.raises(PoolFull, match="cannot reserve"):
        await duvm.Pool(addrs, "app:huge:1", pages=10**6).open()
    blocker = duvm.Pool(addrs[1:], "app:blocker:1", pages=1000)
    await blocker.open()
    with pytest.raises(PoolFull, match="cannot reserve"):  # fits on one memserver only
        await duvm.Pool(addrs, "app:half:1", pages=200).open()
    assert (await query_status(*addrs[0]))["reserved_pages"] == 0  # its share was released
    await blocker.close()
    with pytest.raises(PoolError, match="cannot reach memserver"):
        await duvm.Pool([("127.0.0.1", 1)], "app:x:1", pages=1).open()
    with pytest.raises(ValueError, match="4096 bytes"):
        async with duvm.Pool(addrs, "app:v:1", pages=1) as pool:
            await pool.store(1, b"short")
    assert [(await query_status(*a))["reserved_pages"] for a in addrs] == [0, 0]


async def test_pool_authenticates_to_a_memserver_that_requires_the_secret() -> None:
    secret = os.urandom(32)
    srv = MemServer(1 << 20, lease_s=60, lock=False, keyring=auth.Keyring((secret,)))
    addr = await srv.start()
    try:
        with pytest.raises(PoolError):  # no secret: refused before any page moves
            async with duvm.Pool([addr], "myapp:auth:0", pages=4):
                pass
        good = auth.PeerSecurity(auth.Keyring((secret,)))
        async with duvm.Pool([addr], "myapp:auth:1", pages=4, security=good) as pool:
            await pool.store(1, b"k" * PS)
            assert await pool.load(1) == b"k" * PS
    finally:
        await srv.close()
