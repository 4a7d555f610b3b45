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
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from duvm.memserver.server import MemServer
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable
from duvm.wire import pageproto as pp
from duvm.wire.pagedecode import NEED_DATA, Decoder
from memserver_relay import Relay

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


class CutAfterWelcome(Relay):
    """Closes each connection as soon as it has forwarded the memserver's WELCOME
    (HelloReply) to the client."""

    cut = 0

    async def down(self, s_r: asyncio.StreamReader, c_w: asyncio.StreamWriter) -> None:
        dec = Decoder("client")
        while data := await s_r.read(1 << 16):
            dec.receive_data(data)
            c_w.write(data)
            while (msg := dec.next_event()) is not NEED_DATA:
                if isinstance(msg, pp.HelloReply):
                    c_w.close()  # at once: the FIN follows the WELCOME
                    self.cut += 1
                    return


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
                assert client.pending == {}  # nothing left waiting for an answer
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
                assert client.pending == {}
            finally:
                await client.close()

    run(loop, main)


class ResetAtAccept:
    """A listener that accepts each TCP connection and resets it at once (SO_LINGER 0), from
    its own thread: a memserver killed between the TCP handshake and the HELLO."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    def __enter__(self) -> ResetAtAccept:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_connection_reset_before_connect_returns_fails_not_hangs(loop: str) -> None:
    """The peer resets the connection right after the TCP handshake, so the connection is
    lost before `create_connection` has even returned the transport to `connect()`. The
    HELLO must not be sent into that dead transport and wait forever (it did: the reconnect
    then hung, and every request to that memserver waited on it). Where the reset lands
    among the loop's steps depends on the loop and on how busy it is, so both an idle loop
    and one with other work in each iteration are tried."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        busy: list[asyncio.Handle] = []

        pause = [0.0]

        def other_work() -> None:  # each loop iteration takes a while, as in a busy daemon
            time.sleep(pause[0])
            busy[:] = [loop.call_soon(other_work)]

        with ResetAtAccept() as srv:
            host, port = srv.address
            client = MemClient(host, port, "reset-at-accept", connect_timeout=2.0)
            try:
                other_work()
                for attempt in range(30):
                    pause[0] = (0.0, 0.0005, 0.002)[attempt % 3]
                    async with asyncio.timeout(10):
                        with pytest.raises(MemserverUnreachable):
                            await client.connect()
                    assert client._proto is None and client.pending == {}
                async with asyncio.timeout(10):  # through a request, which reconnects
                    with pytest.raises(MemserverUnreachable):
                        await client.status()
                assert srv.accepted >= 31  # the connections were made, then reset
                assert client.pending == {} and not client.connected
            finally:
                if busy:
                    busy[0].cancel()
                await client.close()

    run(loop, main)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_late_loss_report_of_a_replaced_connection_leaves_the_new_ones_requests(
    loop: str,
) -> None:
    """A connection's loss can be reported after a newer connection took over (the old
    transport closed late). That report is the old connection's alone: requests waiting on
    the new connection must still get their answers."""

    async def main() -> None:
        srv = MemServer(1 << 20, lock=False)
        host, port = await srv.start()
        client = MemClient(host, port, "late-loss", connect_timeout=2.0)
        try:
            await client.connect()
            old = client._proto
            assert old is not None and old.transport is not None
            old.transport.abort()  # the first connection goes; the next request reconnects
            await asyncio.sleep(0.05)
            await client.status()
            new = client._proto
            assert new is not None and new is not old
            # a request in flight on the new connection when the old loss is reported again
            pending = asyncio.ensure_future(client.status())
            await asyncio.sleep(0)
            client.reply_connection_lost(old, ConnectionResetError("late report"))
            async with asyncio.timeout(10):
                reply = await pending
            assert reply["capacity_pages"] > 0  # answered, not failed by the old loss
            assert client._proto is new and client.connected
        finally:
            await client.close()
            await srv.close()

    run(loop, main)
