"""A memserver connection that fails at an awkward moment must fail the requests on it, never
leave one waiting forever (the daemon would then hold an NBD request, and the kernel, hostage).

Real parts only: in-process memservers on loopback, the real `MemClient`, and, where a link
must die at one exact protocol step, a TCP relay that forwards bytes both ways and cuts the
connection right after it has passed the memserver's WELCOME (the answer that completes the
handshake), the way a memserver crashing right after accepting a client would. Every test
runs under both event loops the project uses (asyncio's and uvloop's, the daemon's).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from duvm import pageproto as pp
from duvm.memclient import MemClient, MemserverUnreachable
from duvm.memserver import MemServer

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


class CutAfterWelcome:
    """A TCP relay in front of a memserver that closes each connection as soon as it has
    forwarded the memserver's WELCOME (HelloReply) to the client."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.connections = 0
        self.cut = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _relay(self, c_r: asyncio.StreamReader, c_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        s_r, s_w = await asyncio.open_connection(*self.target)

        async def up() -> None:  # client -> memserver, as is
            while data := await c_r.read(1 << 16):
                s_w.write(data)

        async def down() -> None:  # memserver -> client, until WELCOME has passed
            dec = pp.Decoder("client")
            while data := await s_r.read(1 << 16):
                dec.receive_data(data)
                c_w.write(data)
                while (msg := dec.next_event()) is not pp.NEED_DATA:
                    if isinstance(msg, pp.HelloReply):
                        c_w.close()  # at once: the FIN follows the WELCOME
                        self.cut += 1
                        return

        tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            self._tasks.difference_update(tasks)
            for w in (c_w, s_w):
                w.close()


@contextlib.asynccontextmanager
async def cut_after_welcome() -> AsyncIterator[tuple[CutAfterWelcome, tuple[str, int]]]:
    srv = MemServer(1 << 20, lock=False)
    relay = CutAfterWelcome(await srv.start())
    try:
        yield relay, await relay.start()
    finally:
        await relay.close()
        await srv.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_request_after_a_reconnect_that_drops_at_once_fails_not_hangs(loop: str) -> None:
    """The caller of a request (here STATUS) waits for the reconnect, and the new connection
    is gone again before it resumes: its request then meets no connection at all. It must
    fail (and be retried once, as requests are), never wait in the table of a connection
    that no longer exists."""

    async def main() -> None:
        async with cut_after_welcome() as (relay, (host, port)):
            client = MemClient(host, port, "cut-after-welcome", connect_timeout=2.0)
            try:
                async with asyncio.timeout(10):  # the bug: waited forever
                    with pytest.raises(MemserverUnreachable):
                        await client.status()
                # mechanism: both tries got through the handshake, and then lost the link
                assert relay.connections == 2 and relay.cut == 2
                assert client._pending == {}  # nothing left waiting for an answer
                assert not client.connected
            finally:
                await client.close()

    run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_pages_request_after_a_reconnect_that_drops_at_once_fails_not_hangs(loop: str) -> None:
    """The same for a LOAD (merged page requests take another path to the wire)."""

    async def main() -> None:
        async with cut_after_welcome() as (relay, (host, port)):
            client = MemClient(host, port, "cut-after-welcome-load", connect_timeout=2.0)
            try:
                async with asyncio.timeout(10):
                    with pytest.raises(MemserverUnreachable):
                        await client.load([1, 2])
                assert relay.connections == 2 and relay.cut == 2
                assert client._pending == {}
            finally:
                await client.close()

    run(loop, main)
