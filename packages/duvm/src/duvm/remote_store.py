"""`RemoteStore`: a BlockStore whose pages live in memservers' RAM.

Usage (the NBD daemon does exactly this)::

    store = await RemoteStore.open([("10.0.0.2", 7070), ("10.0.0.3", 7070)],
                                   size=4 << 30, client_id="node1:/dev/nbd0:1732900000")
    await store.write(0, memoryview(page))      # BlockStore interface, page-aligned
    ...
    await store.close()                          # RELEASEs the pages on every memserver

`RemoteStore(peers, size, client_id, *, slab_pages=256, replicas=1, connect_timeout=5.0)`
builds an unopened store; `await store.connect()` (or the `open` class method, which does both)
connects to every peer, places the slabs and reserves their capacity. It raises
`StorageError(EHOSTUNREACH)` when a peer cannot be reached and `StorageError(ENOSPC)` when
the peers cannot cover the export, in both cases holding no reservation afterwards.

Theory of operation:

- The export is cut into slabs of `slab_pages` pages. Before the export is offered, every slab
  is placed on `replicas` distinct memservers (round-robin over peers that still have
  unreserved room) and each memserver RESERVEs the pages of its slabs. Reserve before exposing:
  a write the kernel sends always has somewhere to go.
- Page p of the export is key p in this client's namespace on each memserver of its slab.
- A local byte per page records which pages hold data. Reads of never-written (or trimmed)
  pages are zeros filled here, with no network trip; TRIM and WRITE_ZEROES free only pages that
  hold data. A page is marked after its STORE is acknowledged and unmarked around its FREE, so
  a read never LOADs a page that was never stored; if a memserver still answers NOT_FOUND
  (its lease expired while unreachable), the read fails with EIO, never returns other bytes.
- Requests to one memserver share one `MemClient` connection and pipeline over it; a request
  spanning slabs becomes one batched request per slab, sent concurrently, and it completes only
  when every part has (so the caller's buffer is never touched after we return).
- Replication: writes and frees go to every replica of a slab and succeed only when all do;
  reads try the replicas in order. R=1 is the default; failover beyond that (re-replication,
  degraded mode) is not done here yet.
- Requests must be page-aligned (the NBD layer advertises a 4096-byte minimum block and checks
  it); anything else is refused with EINVAL.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Iterator

from duvm.memclient import MemClient, MemserverUnreachable, PageServerError
from duvm.pageproto import ErrorCode
from duvm.storage import PAGE_SIZE, BlockStore, Capabilities, StorageError

log = logging.getLogger(__name__)

DEFAULT_SLAB_PAGES = 256  # 1 MiB slabs: fine-grained placement, big enough for batched I/O
_MASK = PAGE_SIZE - 1
_ZEROS = bytes(256 * PAGE_SIZE)
_ZERO_PAGE = _ZEROS[:PAGE_SIZE]
assert PAGE_SIZE == 1 << 12  # the hot paths shift by 12


def _storage_error(e: Exception, what: str) -> StorageError:
    if isinstance(e, PageServerError) and e.code == ErrorCode.NO_SPACE:
        return StorageError(errno.ENOSPC, f"{what}: {e}")
    return StorageError(errno.EIO, f"{what}: {e}")


class RemoteStore(BlockStore):
    """`size` bytes (a multiple of 4096) on the memservers `peers`, in namespace `client_id`."""

    capabilities = Capabilities()

    def __init__(self, peers: list[tuple[str, int]], size: int, client_id: str, *,
                 slab_pages: int = DEFAULT_SLAB_PAGES, replicas: int = 1,
                 connect_timeout: float = 5.0) -> None:  # fmt: skip
        if size <= 0 or size & _MASK:
            raise ValueError(f"size must be a positive multiple of {PAGE_SIZE}, not {size}")
        if not peers:
            raise ValueError("at least one memserver is needed")
        if len(set(peers)) != len(peers):
            raise ValueError("a memserver is listed twice")
        if slab_pages < 1:
            raise ValueError("slab_pages must be positive")
        if not 1 <= replicas <= len(peers):
            raise ValueError(f"replicas must be 1..{len(peers)} (the number of peers)")
        self.size = size
        self.pages = size // PAGE_SIZE
        self.client_id = client_id
        self.slab_pages = slab_pages
        self.replicas = replicas
        self.clients = [MemClient(h, p, client_id, connect_timeout=connect_timeout)
                        for h, p in peers]  # fmt: skip
        self.nslabs = -(-self.pages // slab_pages)
        self.placement: list[tuple[int, ...]] = []  # slab -> peer indices (replica set)
        self._slab_clients: list[tuple[MemClient, ...]] = []
        self._written = bytearray(self.pages)  # 1 = page holds data on its memservers
        self._open = False
        self.stats = {"loads": 0, "stores": 0, "frees": 0, "zero_reads": 0, "pages_loaded": 0,
                      "pages_stored": 0, "pages_freed": 0}  # fmt: skip

    @classmethod
    async def open(cls, peers: list[tuple[str, int]], size: int, client_id: str,
                   **kwargs: object) -> RemoteStore:  # fmt: skip
        """Build, connect and reserve; see `connect`."""
        store = cls(peers, size, client_id, **kwargs)  # type: ignore[arg-type]
        await store.connect()
        return store

    # --- setup ---

    async def connect(self) -> None:
        """Connect to every peer, place the slabs and reserve them. All or nothing."""
        results = await asyncio.gather(*(c.connect() for c in self.clients),
                                       return_exceptions=True)  # fmt: skip
        failed = [f"{c.peer} ({r})" for c, r in zip(self.clients, results, strict=True)
                  if isinstance(r, BaseException)]  # fmt: skip
        try:
            if failed:
                raise StorageError(errno.EHOSTUNREACH,
                                   "memserver unreachable: " + "; ".join(failed))  # fmt: skip
            # A namespace resumed by a new store holds pages nobody can name any more.
            stale = [c for c in self.clients if c.hello.stored_pages or c.hello.reserved_pages]
            if stale:
                await asyncio.gather(*(c.release() for c in stale))
            statuses = await asyncio.gather(*(c.status() for c in self.clients))
            room = [s["unreserved_pages"] for s in statuses]
            self.placement = self._place(room)
            want = [0] * len(self.clients)
            for slab, peers in enumerate(self.placement):
                n = min(self.slab_pages, self.pages - slab * self.slab_pages)
                for i in peers:
                    want[i] += n
            res = await asyncio.gather(*(c.reserve(n) for c, n in zip(self.clients, want,
                                                                      strict=True) if n),
                                       return_exceptions=True)  # fmt: skip
            errs = [r for r in res if isinstance(r, BaseException)]
            if errs:
                raise _storage_error(errs[0], "reserving capacity failed")
        except BaseException:
            await self._abandon()
            raise
        self._slab_clients = [tuple(self.clients[i] for i in peers) for peers in self.placement]
        self._open = True
        log.info("export of %d pages reserved as %d slabs on %d memservers (R=%d)",
                 self.pages, self.nslabs, len(self.clients), self.replicas)  # fmt: skip

    def _place(self, room: list[int]) -> list[tuple[int, ...]]:
        """Round-robin slabs over peers with room; raises StorageError(ENOSPC) when short."""
        room = list(room)
        unreserved = sum(room)
        npeers, placement, cursor = len(room), [], 0
        for slab in range(self.nslabs):
            n = min(self.slab_pages, self.pages - slab * self.slab_pages)
            chosen: list[int] = []
            for k in range(npeers):
                i = (cursor + k) % npeers
                if room[i] >= n:
                    chosen.append(i)
                    if len(chosen) == self.replicas:
                        break
            if len(chosen) < self.replicas:
                raise StorageError(
                    errno.ENOSPC,
                    f"the pool cannot hold the export: {self.size >> 20} MiB x {self.replicas} "
                    f"replica(s) needed, {unreserved * PAGE_SIZE >> 20} MiB unreserved on "
                    f"{npeers} memserver(s)",
                )
            for i in chosen:
                room[i] -= n
            placement.append(tuple(chosen))
            cursor = (chosen[0] + 1) % npeers
        return placement

    async def _abandon(self) -> None:
        for c in self.clients:
            if c.connected:
                try:
                    await c.release()
                except (PageServerError, MemserverUnreachable) as e:
                    log.warning("could not release on %s: %s", c.peer, e)
            await c.close()

    async def release(self) -> None:
        """Free every page and reservation on the memservers (the data is gone afterwards)."""
        if not self._open:
            return
        self._open = False
        self._written = bytearray(self.pages)
        await self._abandon()

    async def close(self) -> None:
        """Release the pages on every memserver and close the connections."""
        await self.release()

    async def peer_status(self) -> list[dict | None]:
        """Each memserver's STATUS (None for a peer that cannot answer)."""
        res = await asyncio.gather(*(c.status() for c in self.clients), return_exceptions=True)
        return [None if isinstance(r, BaseException) else r for r in res]

    # --- block I/O ---

    def _check(self, offset: int, length: int) -> None:
        """Raise for a request the hot paths' quick test flagged."""
        if (offset | length) & _MASK:
            raise StorageError(errno.EINVAL, f"unaligned request ({offset}, {length}): "
                               f"offsets and lengths must be multiples of {PAGE_SIZE}")  # fmt: skip
        if not self._open:
            raise StorageError(errno.EIO, "store is not open")

    def _runs(self, first: int, count: int) -> Iterator[tuple[int, int, int]]:
        """Split pages [first, first+count) at slab boundaries: (slab, first, count)."""
        sp, end = self.slab_pages, first + count
        while first < end:
            slab = first // sp
            stop = min(end, (slab + 1) * sp)
            yield slab, first, stop - first
            first = stop

    @staticmethod
    async def _all(coros: list) -> None:
        """Await every part, then raise the first failure (no part outlives the request)."""
        if len(coros) == 1:
            await coros[0]
            return
        for r in await asyncio.gather(*coros, return_exceptions=True):
            if isinstance(r, BaseException):
                raise r

    async def read(self, offset: int, out: memoryview) -> None:
        n = len(out)
        if (offset | n) & _MASK or not self._open:
            self._check(offset, n)
        first, count, w = offset >> 12, n >> 12, self._written
        if count == 1:  # the swap path's common case, kept short
            if not w[first]:
                out[:] = _ZERO_PAGE
                self.stats["zero_reads"] += 1
                return
            clients = self._slab_clients[first // self.slab_pages]
            if len(clients) == 1:
                self.stats["loads"] += 1
                try:
                    await clients[0].load_batch((first,), out)
                    return
                except (PageServerError, MemserverUnreachable):
                    pass  # the general path retries (reconnecting) and reports
            await self._load(first // self.slab_pages, first, 1, out)
            return
        parts, p, end = [], first, first + count
        while p < end:
            q = w.find(1, p, end)
            q = end if q < 0 else q
            self._zero(out, (p - first) * PAGE_SIZE, (q - first) * PAGE_SIZE)
            if q == end:
                break
            r = w.find(0, q, end)
            r = end if r < 0 else r
            for slab, s, n in self._runs(q, r - q):
                a = (s - first) * PAGE_SIZE
                parts.append(self._load(slab, s, n, out[a : a + n * PAGE_SIZE]))
            p = r
        if parts:
            await self._all(parts)

    def _zero(self, out: memoryview, a: int, b: int) -> None:
        if a < b:
            self.stats["zero_reads"] += 1
        while a < b:
            n = min(b - a, len(_ZEROS))
            out[a : a + n] = _ZEROS[:n]
            a += n

    async def _load(self, slab: int, first: int, count: int, out: memoryview) -> None:
        self.stats["loads"] += 1
        self.stats["pages_loaded"] += count
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        err: Exception | None = None
        for client in self._slab_clients[slab]:
            try:
                if client.connected and count <= client.max_batch:
                    try:
                        await client.load_batch(keys, out)
                        return
                    except MemserverUnreachable:
                        pass  # load() below reconnects and retries once
                await client.load(keys, out)
                return
            except (PageServerError, MemserverUnreachable) as e:
                err = e
                log.warning("LOAD of pages %d..%d from %s failed: %s", first,
                            first + count - 1, client.peer, e)  # fmt: skip
        assert err is not None
        if isinstance(err, PageServerError) and err.code == ErrorCode.NOT_FOUND:
            raise StorageError(errno.EIO, f"pages {first}..{first + count - 1} were lost by "
                               f"their memserver(s): {err}")  # fmt: skip
        raise _storage_error(err, f"reading pages {first}..{first + count - 1}")

    async def write(self, offset: int, data: memoryview) -> None:
        n = len(data)
        if (offset | n) & _MASK or not self._open:
            self._check(offset, n)
        first, count = offset >> 12, n >> 12
        if count == 1:  # the swap path's common case, kept short
            clients = self._slab_clients[first // self.slab_pages]
            if len(clients) == 1:
                self.stats["stores"] += 1
                try:
                    await clients[0].store_batch((first,), data)
                except MemserverUnreachable:
                    pass  # the general path below reconnects, retries and reports
                except PageServerError as e:
                    raise _storage_error(e, f"writing page {first}") from None
                else:
                    self._written[first] = 1
                    return
        slab = first // self.slab_pages
        if (first + count - 1) // self.slab_pages == slab:  # within one slab: no splitting
            await self._store(slab, first, count, data)
            return
        parts = []
        for slab, s, n in self._runs(first, count):
            a = (s - first) * PAGE_SIZE
            parts.append(self._store(slab, s, n, data[a : a + n * PAGE_SIZE]))
        await self._all(parts)

    async def _store(self, slab: int, first: int, count: int, data: memoryview) -> None:
        self.stats["stores"] += 1
        self.stats["pages_stored"] += count
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        clients = self._slab_clients[slab]
        try:
            if len(clients) == 1 and count <= clients[0].max_batch:
                try:
                    await clients[0].store_batch(keys, data)
                except MemserverUnreachable:
                    await clients[0].store(keys, data)  # reconnects and retries once
            else:
                await self._all([c.store(keys, data) for c in clients])
        except (PageServerError, MemserverUnreachable) as e:
            raise _storage_error(e, f"writing pages {first}..{first + count - 1}") from None
        if count == 1:
            self._written[first] = 1
        else:
            self._written[first : first + count] = b"\x01" * count

    async def trim(self, offset: int, length: int) -> None:
        self._check(offset, length)
        first, count = offset // PAGE_SIZE, length // PAGE_SIZE
        w, end = self._written, first + count
        by_client: dict[MemClient, list[int]] = {}  # one batched FREE per memserver
        freed = 0
        p = w.find(1, first, end)
        while p >= 0:
            q = w.find(0, p, end)
            q = end if q < 0 else q
            for slab, s, n in self._runs(p, q - p):
                for c in self._slab_clients[slab]:
                    by_client.setdefault(c, []).extend(range(s, s + n))
                freed += n
            p = w.find(1, q, end) if q < end else -1
        if not by_client:
            return
        w[first:end] = bytes(count)  # reads during the FREE see zeros, as they will after
        parts = [c.free(keys) for c, keys in by_client.items()]
        try:
            await self._all(parts)
        except (PageServerError, MemserverUnreachable) as e:
            raise _storage_error(e, f"freeing pages {first}..{end - 1}") from None
        finally:
            # A STORE sent before this FREE on the same connection was acknowledged before it;
            # clear again so such a write's mark does not outlive the page it refers to.
            w[first:end] = bytes(count)
            self.stats["frees"] += len(parts)
            self.stats["pages_freed"] += freed
