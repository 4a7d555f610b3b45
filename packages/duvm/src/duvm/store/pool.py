"""`duvm.Pool`: the explicit Python API to the page pool, for programs that want control.

Transparent use needs none of this (the kernel swaps to the duvm device). A program that wants
to park its own pages in other nodes' RAM opens a Pool::

    async with duvm.Pool([("10.0.0.2", 7070)], "myapp:cache:1", pages=1024) as pool:
        await pool.store(7, page)                      # one 4096-byte page under key 7
        await pool.store_many([1, 2, 3], three_pages)  # a batch, one request per memserver
        data = await pool.load(7)                      # bytes; PoolKeyError if absent
        await pool.free([1, 2])

Theory of operation: a Pool is one namespace (`client_id`) on each of its memservers, over the
same `MemClient` connections the NBD daemon uses. Keys are the caller's page numbers (any
integer in [0, 2**64)); keys are spread over the memservers in groups of `GROUP_PAGES`
consecutive keys (key // GROUP_PAGES modulo the number of memservers), so batches of nearby
keys stay one request. `open()` reserves `pages` split evenly over the memservers (rounded
up), so a store is refused (PoolFull) once a memserver's share is used, never queued or
allocated beyond it. Closing releases everything unless `close(release=False)`, which keeps
the pages for the memservers' lease so a process restarting with the same client id finds them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Iterable, Sequence
from types import TracebackType

from duvm.store.memclient import MemClient
from duvm.store.memclient_group import fence_all
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.wire.auth import PeerSecurity
from duvm.wire.pageproto import PAGE_SIZE, ErrorCode, keys_tuple

GROUP_PAGES = 256


class PoolError(Exception):
    """A pool operation failed; `errno` says how (ENOSPC, ENOENT, EIO, ...)."""

    def __init__(self, message: str, err: int) -> None:
        super().__init__(message)
        self.errno = err


class PoolFull(PoolError):
    """The memserver's share of the reservation is used up."""


class PoolKeyError(PoolError, KeyError):
    """A key that is not stored in the pool."""

    def __str__(self) -> str:
        return str(self.args[0])


def _translate(e: Exception, what: str) -> PoolError:
    if isinstance(e, PageServerError):
        if e.code == ErrorCode.NO_SPACE:
            return PoolFull(f"{what}: {e}", e.errno)
        if e.code == ErrorCode.NOT_FOUND:
            return PoolKeyError(f"{what}: {e}", e.errno)
        return PoolError(f"{what}: {e}", e.errno)
    return PoolError(f"{what}: {e}", errno.EIO)


class Pool:
    """Pages in other nodes' RAM under keys you choose. Use as `async with` or open/close."""

    def __init__(
        self,
        peers: Sequence[tuple[str, int]],
        client_id: str,
        *,
        pages: int,
        connect_timeout: float = 5.0,
        security: PeerSecurity | None = None,
    ) -> None:
        """`security`: how to authenticate to memservers that require the cluster secret or
        TLS (e.g. `PeerSecurity(Keyring.from_file(path))`); pages travel as given, so
        encrypt them first if a memserver must not read them."""
        if not peers:
            raise ValueError("a Pool needs at least one memserver")
        if pages < 1:
            raise ValueError("pages must be positive")
        self.pages = pages
        self.client_id = client_id
        self.clients = [
            MemClient(h, p, client_id, connect_timeout=connect_timeout, security=security)
            for h, p in peers
        ]

    async def __aenter__(self) -> Pool:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def open(self) -> None:
        """Connect to every memserver and reserve this pool's share on each."""
        share = -(-self.pages // len(self.clients))
        try:
            await self._gather([c.connect() for c in self.clients], "connect", raw=True)
            await self._gather(
                [c.reserve(max(share, c.hello.stored_pages)) for c in self.clients],
                "reserve",
                raw=True,
            )
        except (PageServerError, MemserverUnreachable) as e:
            await self.close()  # release what was reserved: all or nothing
            raise _translate(e, "opening the pool") from None

    async def close(self, *, release: bool = True) -> None:
        """Release the pages (default) or keep them for the lease, and disconnect."""
        for c in self.clients:
            if release and c.connected:
                # unreachable: the memserver's lease frees them anyway
                with contextlib.suppress(PageServerError, MemserverUnreachable):
                    await c.release()
            await c.close()

    def _client(self, key: int) -> MemClient:
        return self.clients[(key // GROUP_PAGES) % len(self.clients)]

    def _split(self, keys: tuple[int, ...]) -> dict[int, list[int]]:
        """Client index -> positions in `keys` that it holds."""
        n = len(self.clients)
        parts: dict[int, list[int]] = {}
        for pos, k in enumerate(keys):
            parts.setdefault((k // GROUP_PAGES) % n, []).append(pos)
        return parts

    async def store(self, key: int, data: bytes | bytearray | memoryview) -> None:
        """Store one page (exactly 4096 bytes) under `key`, replacing what was there."""
        await self.store_many([key], data)

    async def store_many(self, keys: Iterable[int], data: bytes | bytearray | memoryview) -> None:
        """Store len(keys) pages from `data` (back to back). All or nothing per memserver."""
        keys = keys_tuple(keys)
        mv = memoryview(data).cast("B")
        if mv.nbytes != len(keys) * PAGE_SIZE:
            raise ValueError(
                f"{len(keys)} pages need {len(keys) * PAGE_SIZE} bytes, got {mv.nbytes}"
            )
        if not keys:
            return
        parts = self._split(keys)
        jobs = []
        for ci, positions in parts.items():
            if len(parts) == 1:
                jobs.append(self.clients[ci].store(keys, mv))
                break
            sub = bytearray(len(positions) * PAGE_SIZE)
            for j, pos in enumerate(positions):
                a = pos * PAGE_SIZE
                sub[j * PAGE_SIZE : (j + 1) * PAGE_SIZE] = mv[a : a + PAGE_SIZE]
            jobs.append(self.clients[ci].store([keys[p] for p in positions], sub))
        await self._gather(jobs, "store")

    async def load(self, key: int) -> bytes:
        """The page stored under `key`. Raises PoolKeyError when there is none."""
        return bytes(await self.load_many([key]))

    async def load_many(
        self, keys: Iterable[int], out: bytearray | memoryview | None = None
    ) -> bytearray | None:
        """Load pages into `out` (or a new bytearray, returned). PoolKeyError if any is absent."""
        keys = keys_tuple(keys)
        ret = None
        if out is None:
            ret = out = bytearray(len(keys) * PAGE_SIZE)
        mv = memoryview(out).cast("B")
        if mv.nbytes != len(keys) * PAGE_SIZE:
            raise ValueError(f"out must be {len(keys) * PAGE_SIZE} bytes")
        if not keys:
            return ret
        parts = self._split(keys)
        if len(parts) == 1:
            await self._gather([self.clients[next(iter(parts))].load(keys, mv)], "load")
            return ret
        jobs, scatter = [], []
        for ci, positions in parts.items():
            sub = bytearray(len(positions) * PAGE_SIZE)
            scatter.append((positions, sub))
            jobs.append(self.clients[ci].load([keys[p] for p in positions], sub))
        await self._gather(jobs, "load")
        for positions, sub in scatter:
            for j, pos in enumerate(positions):
                a = j * PAGE_SIZE
                mv[pos * PAGE_SIZE : (pos + 1) * PAGE_SIZE] = sub[a : a + PAGE_SIZE]
        return ret

    async def free(self, keys: Iterable[int]) -> int:
        """Forget pages; returns how many were stored. Absent keys are ignored."""
        keys = keys_tuple(keys)
        parts = self._split(keys)
        counts = await self._gather(
            [self.clients[ci].free([keys[p] for p in pos]) for ci, pos in parts.items()], "free"
        )
        return sum(counts)

    async def fence_all(self, epoch: int) -> list[int | Exception | None]:
        """Write as generation `epoch` from now on, on every memserver at once (FENCE, see
        `duvm.store.memclient_group.fence_all`): per memserver, its namespace's epoch, None
        when not connected (the reconnect fences), or the exception met; never raises for one."""
        return await fence_all(self.clients, epoch)

    async def status(self) -> list[dict]:
        """Each memserver's STATUS (capacity, used, reserved, namespaces, connections)."""
        return await self._gather([c.status() for c in self.clients], "status")

    @staticmethod
    async def _gather(jobs: list, what: str, *, raw: bool = False) -> list:
        """Await all jobs, then raise the first failure (translated unless `raw`)."""
        res = await asyncio.gather(*jobs, return_exceptions=True)
        for r in res:
            if raw and isinstance(r, BaseException):
                raise r
            if isinstance(r, (PageServerError, MemserverUnreachable)):
                raise _translate(r, what) from None
            if isinstance(r, BaseException):
                raise r
        return res
