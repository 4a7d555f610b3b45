"""Fixtures shared by the duvm tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from duvm.memserver import MemServer

StartPool = Callable[..., Awaitable[tuple[list[MemServer], list[tuple[str, int]]]]]


@pytest.fixture
async def memserver_pool() -> AsyncIterator[StartPool]:
    """`await memserver_pool(n, capacity)` starts n in-process memservers on loopback.

    Returns (servers, addresses). At teardown every server then in the returned list is closed,
    so a test that replaces `servers[i]` with a restarted one gets that one closed too.
    """
    pools: list[list[MemServer]] = []

    async def start(n: int, capacity: int, lease_s: float = 60) -> tuple[
            list[MemServer], list[tuple[str, int]]]:
        srvs = [MemServer(capacity, lease_s=lease_s, lock=False) for _ in range(n)]
        pools.append(srvs)
        addrs = [await s.start() for s in srvs]
        return srvs, addrs

    try:
        yield start
    finally:
        for srvs in pools:
            for s in srvs:
                await s.close()
