"""A TCP relay in front of a memserver that misbehaves on purpose: each subclass decides what
reaches the client of the memserver's bytes (a connection cut after its WELCOME, a LOAD reply
cut short), so a client meets a broken memserver that is otherwise real."""

from __future__ import annotations

import asyncio


class Relay:
    """Forwards client -> memserver as is and memserver -> client through `down`; counts the
    connections it relayed."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.connections = 0
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

    def admit(self) -> bool:
        """Whether a new client connection is relayed (False: it is closed at once)."""
        return True

    async def up(self, c_r: asyncio.StreamReader, s_w: asyncio.StreamWriter) -> None:
        """What of the client's bytes the memserver gets (here: all of them)."""
        while data := await c_r.read(1 << 16):
            s_w.write(data)

    async def down(self, s_r: asyncio.StreamReader, c_w: asyncio.StreamWriter) -> None:
        """What of the memserver's bytes the client gets (here: all of them)."""
        while data := await s_r.read(1 << 16):
            c_w.write(data)

    async def _relay(self, c_r: asyncio.StreamReader, c_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        if not self.admit():
            c_w.close()
            return
        s_r, s_w = await asyncio.open_connection(*self.target)
        tasks = [
            asyncio.ensure_future(self.up(c_r, s_w)),
            asyncio.ensure_future(self.down(s_r, c_w)),
        ]
        self._tasks.update(tasks)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            self._tasks.difference_update(tasks)
            for w in (c_w, s_w):
                w.close()
