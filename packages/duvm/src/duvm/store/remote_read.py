"""Reads of a `RemoteStore`: LOAD from the first replica that answers and verify every page.

- Never-written (EMPTY) pages are zeros made here, with no network trip; LOST pages fail with
  EIO until they are written again.
- The common read (written pages of one slab, its preferred replica connected) is one LOAD
  whose reply is checked against the slab table's CRC-32C; on the fast path (`ReadFastPath`,
  compiled in `duvm.store._readpath`) that happens in the receive callback, with no
  coroutine.
- Anything else, or any failure, goes through `load_verified`: each replica in turn. A replica
  that is unreachable is skipped (a failover); one that answers NOT_FOUND or bad bytes is
  dropped from the slab. If no replica has good bytes, the pages are lost (EIO from now on); if
  replicas were merely unreachable, the read waits (`unreachable_wait`) for one to come back,
  then fails with EIO, and a later read may still succeed.
- NOT_FOUND for a LOAD of several pages says only that one is missing: the pages are then
  loaded one by one, so that only those missing (or bad) on every replica are lost. A replica
  that lost our namespace unnoticed holds the pages written since; those were acknowledged,
  and never read EIO. Nor does a page rewritten while the read was judging it (its checksum
  changed meanwhile; a rewrite with the very same bytes is not told apart).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from dataclasses import dataclass

from duvm.base import accel
from duvm.store.counters import Counters
from duvm.store.memclient import MemClient
from duvm.store.memserver_errors import MemserverUnreachable, PageServerError
from duvm.store.readahead import Readahead
from duvm.store.replica_errors import (
    REPLICA_FAILURES,
    UnreachableWait,
    all_parts,
    check_request,
)
from duvm.store.replication import Replication
from duvm.store.storage import DATA, EMPTY, LOST, PAGE_SIZE, Done, StorageError
from duvm.wire.pageproto import ErrorCode

log = logging.getLogger(__name__)

_MASK = PAGE_SIZE - 1
_ZEROS = bytes(256 * PAGE_SIZE)
_ZERO_PAGE = _ZEROS[:PAGE_SIZE]


@dataclass(slots=True)
class ReadCounters(Counters):
    loads: int = 0
    pages_loaded: int = 0
    zero_reads: int = 0
    failovers: int = 0
    checksum_failures: int = 0
    read_errors: int = 0
    unreachable_waits: int = 0


class RemoteReads:
    """The read path of a `RemoteStore` over `replication`, with its readahead."""

    def __init__(self, replication: Replication, unreachable_wait: float) -> None:
        self.replication = replication
        self.table = replication.table
        self.unreachable_wait = unreachable_wait
        self.counters = ReadCounters()
        # every change to a page drops the windows that hold it before a read can look: the
        # readahead sets the table's `on_change` while it holds a window
        self.readahead = Readahead(self.table, self.read)
        self.fast = read_path_type()(self)  # the callback fast path

    async def read(self, offset: int, out: memoryview) -> None:
        n = len(out)
        if (offset | n) & _MASK or not self.replication.open:
            check_request(offset, n, self.replication.open)
        t = self.table
        first, count, st = offset >> 12, n >> 12, t.state
        slab = first // t.slab_pages
        if (count == 1 and st[first] == DATA) or (
            (first + count - 1) // t.slab_pages == slab
            and st.count(DATA, first, first + count) == count
        ):
            # The common case (written pages, one slab): one LOAD from the preferred replica,
            # no extra coroutine frames. Anything unusual (a failure, a bad checksum) goes
            # through load_verified, which loads again with failover and judges the replicas.
            c = t.slab_clients[slab][0]
            if c.hello is not None and count <= c.max_batch:
                try:
                    await c.load_batch(
                        (first,) if count == 1 else tuple(range(first, first + count)), out
                    )
                except REPLICA_FAILURES:
                    pass
                else:
                    if not t.bad_pages(first, count, out):
                        counters = self.counters
                        counters.loads += 1
                        counters.pages_loaded += count
                        return
            await self.load_verified(slab, first, count, out)
            return
        if count == 1:
            s = st[first]
            if s == EMPTY:
                out[:] = _ZERO_PAGE
                self.counters.zero_reads += 1
            else:
                self._lost_error(first, 1)
            return
        if st.find(LOST, first, first + count) >= 0:
            self._lost_error(first, count)
        parts, p, end = [], first, first + count
        while p < end:
            q = st.find(DATA, p, end)
            q = end if q < 0 else q
            self._zero(out, (p - first) * PAGE_SIZE, (q - first) * PAGE_SIZE)
            if q == end:
                break
            r = st.find(EMPTY, q, end)
            r = end if r < 0 else r
            for slab, s, k in t.runs(q, r - q):
                a = (s - first) * PAGE_SIZE
                parts.append(self.load_verified(slab, s, k, out[a : a + k * PAGE_SIZE]))
            p = r
        if parts:
            await all_parts(parts)

    def _lost_error(self, first: int, count: int) -> None:
        self.counters.read_errors += 1
        raise StorageError(
            errno.EIO,
            f"pages in {first}..{first + count - 1} were lost by "
            "every replica (memserver restarted, or a write failed everywhere)",
        )

    def _zero(self, out: memoryview, a: int, b: int) -> None:
        if a < b:
            self.counters.zero_reads += 1
        while a < b:
            n = min(b - a, len(_ZEROS))
            out[a : a + n] = _ZEROS[:n]
            a += n

    async def load_verified(self, slab: int, first: int, count: int, out: memoryview) -> None:
        """LOAD pages from the slab's replicas until one returns bytes matching every page's
        checksum. Drops replicas with missing or bad pages; raises EIO if none is good."""
        self.counters.loads += 1
        self.counters.pages_loaded += count
        keys = (first,) if count == 1 else tuple(range(first, first + count))
        wait = UnreachableWait(self.unreachable_wait, self.counters)
        while True:
            unreachable, bad, bad_everywhere = await self._load_round(slab, first, count, keys, out)
            if unreachable is None:
                return
            # a replica may come back: wait, then try again
            if unreachable and self.replication.open and await wait.again():
                continue
            break
        self.counters.read_errors += 1
        what = f"reading pages {first}..{first + count - 1}"
        if not unreachable:  # every replica answered and none had good bytes: gone for good
            st, crc = self.table.state, self.table.crc
            for p, judged in sorted((bad_everywhere or {}).items()):
                if st[p] == DATA and crc[p] == judged:  # not rewritten since it was judged
                    self.table.mark_lost(p, 1)
            raise StorageError(
                errno.EIO, f"{what}: pages were lost by every replica: " + "; ".join(bad)
            )
        raise StorageError(
            errno.EIO,
            f"{what}: no replica answered with good bytes within "
            f"{self.unreachable_wait:.0f} s: " + "; ".join(unreachable + bad),
        )

    async def _load_round(
        self, slab: int, first: int, count: int, keys: tuple[int, ...], out: memoryview
    ) -> tuple:
        """Try each replica once. Returns (None, ...) on success, else the reasons and the
        pages bad on every replica that answered, each with its checksum when judged."""
        t = self.table
        members = t.sets[slab]
        clients = t.slab_clients[slab]
        unreachable: list[str] = []
        bad: list[str] = []
        bad_everywhere: dict[int, int] | None = None  # None: no replica answered yet
        for idx, client in zip(list(members), clients, strict=True):
            missing: list[int] = []
            try:
                await _load_one(client, keys, out)
            except MemserverUnreachable as e:
                self.counters.failovers += 1
                unreachable.append(str(e))
                continue
            except PageServerError as e:
                if e.code != ErrorCode.NOT_FOUND:
                    self.counters.failovers += 1
                    unreachable.append(str(e))
                    continue
                try:
                    missing = await _missing_pages(client, first, count, out)
                except REPLICA_FAILURES as e:
                    self.counters.failovers += 1
                    unreachable.append(str(e))
                    continue
            st = t.state
            gone = []  # missing pages that hold data (or were lost meanwhile)
            for p in missing:
                if st[p] == EMPTY:  # trimmed meanwhile: zeros, as the table says
                    out[(p - first) << 12 : (p - first + 1) << 12] = _ZERO_PAGE
                else:
                    gone.append(p)
            crc_bad = t.bad_pages(first, count, out)
            if missing:  # their bytes were never loaded: missing, not corrupt
                crc_bad = list(set(crc_bad).difference(missing))
            bad_pages = sorted({*crc_bad, *gone})
            if not bad_pages:
                return None, None, None
            crc = t.crc
            bad_everywhere = {
                p: crc[p] if bad_everywhere is None else bad_everywhere[p]
                for p in bad_pages
                if bad_everywhere is None or p in bad_everywhere
            }
            if crc_bad:
                nbad = len(crc_bad)
                self.counters.checksum_failures += nbad
                bad.append(f"{client.peer}: {nbad} page(s) with bad checksums")
                log.error(
                    "slab %d: %d page(s) from %s failed their checksum", slab, nbad, client.peer
                )
            if gone:
                bad.append(f"{client.peer}: {len(gone)} page(s) missing")
            self.replication.drop_replica(slab, idx, "pages missing" if gone else "bad checksum")
        return unreachable, bad, bad_everywhere


async def _missing_pages(client: MemClient, first: int, count: int, out: memoryview) -> list[int]:
    """The pages of [first, first+count) that `client` does not hold, after its LOAD of them
    answered NOT_FOUND: each is loaded on its own (into `out`), so those it holds are read.
    Raises a replica failure other than NOT_FOUND."""
    if count == 1:
        return [first]
    pages = range(first, first + count)
    res = await asyncio.gather(
        *(client.load((p,), out[(p - first) << 12 : (p - first + 1) << 12]) for p in pages),
        return_exceptions=True,
    )
    missing = []
    for p, r in zip(pages, res, strict=True):
        if isinstance(r, PageServerError) and r.code == ErrorCode.NOT_FOUND:
            missing.append(p)
        elif isinstance(r, BaseException):
            raise r
    return missing


async def _load_one(client: MemClient, keys: tuple[int, ...], out: memoryview) -> None:
    if client.hello is not None and len(keys) <= client.max_batch:
        try:
            await client.load_batch(keys, out)
            return
        except MemserverUnreachable:
            pass  # load() below reconnects (if the breaker allows) and retries
    await client.load(keys, out)


class ReadFastPath:
    """The fast path of `RemoteReads`. Compiled twin: `duvm.store._readpath` (see
    `read_path_type`)."""

    __slots__ = ("reads", "replication", "table")

    def __init__(self, reads: RemoteReads) -> None:
        self.reads = reads
        self.replication = reads.replication
        self.table = reads.table

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        """The common read (written pages of one slab, preferred replica connected): one LOAD
        whose reply is checked and answered from the receive path, with no coroutine. Anything
        else, or any failure, continues in `RemoteReads.load_verified` (failover, judging
        replicas)."""
        n = len(out)
        assert not (offset | n) & _MASK, f"unaligned request ({offset}, {n})"
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        reads = self.reads
        if not self.replication.open:
            return False
        t = self.table
        first, count, st = offset >> 12, n >> 12, t.state
        slab = first // t.slab_pages
        if count == 1:
            if st[first] != DATA:
                return False
        elif (first + count - 1) // t.slab_pages != slab or st.count(
            DATA, first, first + count
        ) != count:
            return False
        c = t.slab_clients[slab][0]
        if count > c.max_batch:
            return False
        ra = reads.readahead
        if ra.windows and ra.hit(first, count, out, done, tag):
            return True

        def loaded(exc: BaseException | None) -> None:
            try:
                ok = exc is None and not t.bad_pages(first, count, out)
            except Exception as e:  # never leave the request unanswered
                ok, exc = False, e
            if ok:
                counters = reads.counters
                counters.loads += 1
                counters.pages_loaded += count
                done(tag, None)
            elif exc is None or isinstance(exc, REPLICA_FAILURES):
                done(tag, reads.load_verified(slab, first, count, out))
            else:
                done(tag, exc)

        keys = (first,) if count == 1 else tuple(range(first, first + count))
        if not c.load_cb(keys, out, loaded):
            return False
        try:  # the request is on its way: fetching ahead must not fail it
            ra.missed(first, count)
        except Exception:
            log.exception("readahead failed; reading on without it")
        return True


def read_path_type() -> type[ReadFastPath]:
    """The compiled `ReadFastPath` (duvm.store._readpath) when the compiled path runs here,
    else this one, the reference."""
    compiled = accel.load("duvm.store._readpath")
    return compiled.ReadFastPath if compiled is not None else ReadFastPath
