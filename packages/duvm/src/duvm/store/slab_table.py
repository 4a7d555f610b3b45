"""`SlabTable`: what a `RemoteStore` knows about its pages, and nothing about the network.

- Geometry: the export's `pages`, cut into `nslabs` slabs of `slab_pages` pages (the last may
  be shorter); page p of the export is key p on each memserver of its slab.
- Per page: a state byte (`EMPTY` never written or trimmed: reads are zeros made here; `DATA`;
  `LOST`: reads fail with EIO until it is written again) and the CRC-32C of the bytes last
  acknowledged. Both may live in persisted tables (`state_files.PageTables`).
- Per slab: the live replica set (peer indices, preferred first, and the same as connections)
  and the count of unlocked writes and trims in flight (a repair waits for them).
- The replicated writes still in flight, whose bytes a racing read may already see on one
  replica: they are not corruption.
- The trims in flight (`trim_started` .. `trim_ended`): their pages read as zeros meanwhile,
  and a write that races one never marks them written (`mark_stored`, `record`): its STORE
  may have reached a memserver before the trim's FREE, which then freed the page there.

Every change of a page's state or checksum goes through `mark_stored`, `record`, `mark_lost`,
`mark_in_doubt`, `write_failed`, `clear` or `trim_started`, which first tell `on_change` (the
readahead's `invalidate`, which the readahead sets while it holds a window, and None while it
holds none: then nothing is called), so no window of old bytes outlives a change. Every change of a
slab's replica set goes through `set_replicas`, which tells `on_placement_change` (the daemon
persists the map).

The per-request calls (a replicated write's `write_started`, `mark_stored` and `write_ended`,
a read's `bad_pages`) run compiled where the compiled path is built: `SlabTable` has a twin in
`duvm.store._slabtable` (`slab_table_type` chooses), held to the same behaviour by
tests/test_slab_table.py. This module stays the reference.

The checksum is CRC-32C (the `crc32c` package, SSE4.2 where the CPU has it: about 2.7k
instructions per 4 KiB page against 17k for `zlib.crc32`): it detects corruption; it is no
defence against a malicious memserver, which encryption with authentication covers.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from crc32c import crc32c as crc32

from duvm.base import accel
from duvm.store.counters import Counters
from duvm.store.memclient import MemClient
from duvm.store.storage import DATA, EMPTY, LOST, PAGE_SIZE
from duvm.wire.pageproto import MAX_BATCH

assert PAGE_SIZE == 1 << 12  # the hot paths shift by 12

_PAGE_SLICES = tuple(slice(k << 12, (k + 1) << 12) for k in range(MAX_BATCH))


def page_crcs(buf: memoryview, count: int) -> array:
    """The CRC-32C of each of the first `count` pages of `buf`. The per-page loop runs in C
    (map over precomputed slices): a batch of 64 pages costs no Python bytecode per page."""
    slices = (
        _PAGE_SLICES[:count]
        if count <= len(_PAGE_SLICES)
        else [slice(k << 12, (k + 1) << 12) for k in range(count)]
    )
    return array("I", map(crc32, map(buf.__getitem__, slices)))


def keep_trimmed(table: SlabTable, first: int, count: int) -> None:
    """Pages of [first, first+count) under a trim in flight read as zeros again: a write
    that raced the trim marks them written only once the trim has ended (after the
    acknowledgement of its STORE, the trim's FREE may still free them on a memserver). Both
    twins' `mark_stored` and `record` call it while a trim is in flight."""
    st, end = table.state, first + count
    for f, n in table.trims.values():
        a, b = max(first, f), min(end, f + n)
        if a < b:
            st[a:b] = bytes(b - a)


@dataclass(slots=True)
class TableCounters(Counters):
    pages_lost: int = 0


class SlabTable:
    """Pages, slabs and replica sets of one export of `pages` pages over `clients`."""

    def __init__(
        self,
        pages: int,
        slab_pages: int,
        clients: Sequence[MemClient],
        tables: tuple[Any, Any] | None = None,
    ) -> None:
        self.pages = pages
        self.slab_pages = slab_pages
        self.nslabs = -(-pages // slab_pages)
        self.clients = tuple(clients)
        self.counters = TableCounters()
        self.state = bytearray(pages)  # EMPTY / DATA / LOST per page
        self.crc = array("I", bytes(4 * pages))
        if tables is not None:  # persisted tables (state_files.PageTables: mmap on a ramfs)
            if len(tables[0]) != pages or len(tables[1]) != pages:
                raise ValueError(f"page tables must have {pages} entries")
            self.state, self.crc = tables
        self.sets: list[list[int]] = []  # slab -> live replica peer indices, preferred first
        self.slab_clients: list[tuple[MemClient, ...]] = []  # the same, as connections
        self.inflight = array("i", bytes(4 * self.nslabs))  # unlocked writes/trims per slab
        # replicated writes in flight, by token: (first page, pages, bytes); a racing read may
        # see their bytes on one replica
        self.pending_writes: dict[int, tuple[int, int, memoryview]] = {}
        self._next_token = 0
        self.trims: dict[int, tuple[int, int]] = {}  # trims in flight, by token: (first, pages)
        # pages [first, first+count) change: drop what holds them (None: nothing does)
        self.on_change: Callable[[int, int], None] | None = None
        self.on_placement_change: Callable[[], None] | None = None

    # --- geometry ---

    def slab_size(self, slab: int) -> int:
        return min(self.slab_pages, self.pages - slab * self.slab_pages)

    def runs(self, first: int, count: int) -> Iterator[tuple[int, int, int]]:
        """Split pages [first, first+count) at slab boundaries: (slab, first, count)."""
        sp, end = self.slab_pages, first + count
        while first < end:
            slab = first // sp
            stop = min(end, (slab + 1) * sp)
            yield slab, first, stop - first
            first = stop

    # --- replica sets ---

    def assign(self, placement: list[list[int]]) -> None:
        """Every slab's replica set at once (a new export, or a resumed one)."""
        self.sets = [list(p) for p in placement]
        self.slab_clients = [tuple(self.clients[i] for i in s) for s in self.sets]

    def set_replicas(self, slab: int, members: list[int]) -> None:
        self.sets[slab] = members
        self.slab_clients[slab] = tuple(self.clients[i] for i in members)
        if self.on_placement_change is not None:
            self.on_placement_change()

    def degraded_slabs(self, replicas: int) -> list[int]:
        """Slabs with fewer than `replicas` live replicas."""
        return [s for s, m in enumerate(self.sets) if len(m) < replicas]

    def pages_per_peer(self) -> list[int]:
        """Written pages held by each peer (a page counts once per replica)."""
        out = [0] * len(self.clients)
        sp, st = self.slab_pages, self.state
        for s, members in enumerate(self.sets):
            n = st.count(DATA, s * sp, (s + 1) * sp)
            if n:
                for i in members:
                    out[i] += n
        return out

    # --- page state ---

    def mark_stored(self, first: int, count: int, data: memoryview, crcs: array | None) -> None:
        """Every live replica acknowledged one STORE of these pages: they hold `data` (whose
        page checksums are `crcs`, when already computed) from now on."""
        if self.on_change is not None:
            self.on_change(first, count)
        st, crc = self.state, self.crc
        if count == 1:
            crc[first] = crc32(data)
            st[first] = DATA
        else:
            crc[first : first + count] = page_crcs(data, count) if crcs is None else crcs
            st[first : first + count] = bytes((DATA,)) * count
        if self.trims:
            keep_trimmed(self, first, count)

    def record(self, first: int, count: int, crcs: Sequence[int]) -> None:
        """The pages hold bytes with checksums `crcs` (a write counted by its caller)."""
        if self.on_change is not None:
            self.on_change(first, count)
        st, crc = self.state, self.crc
        for k in range(count):
            crc[first + k] = crcs[k]
            st[first + k] = DATA
        if self.trims:
            keep_trimmed(self, first, count)

    def mark_lost(self, first: int, count: int) -> None:
        """The written pages among these are lost: reads fail with EIO until rewritten."""
        if self.on_change is not None:
            self.on_change(first, count)
        st = self.state
        for p in range(first, first + count):
            if st[p] == DATA:
                st[p] = LOST
                self.counters.pages_lost += 1

    def mark_in_doubt(self, first: int, count: int) -> None:
        """A write of these pages failed on a replica after it may have reached another, and
        goes on in the general path: the replicas may disagree, so every page reads EIO until
        a write of it is acknowledged (also if that never runs). Not counted as lost: a write
        that then fails counts its pages (`write_failed`)."""
        if self.on_change is not None:
            self.on_change(first, count)
        self.state[first : first + count] = bytes((LOST,)) * count

    def write_failed(self, first: int, count: int) -> None:
        """A write of these pages failed (or was given up) after it may have reached a
        replica: every page, written before or not, reads EIO until it is written again; never
        the bytes from before the write (nor zeros). Each counts as lost."""
        if self.on_change is not None:
            self.on_change(first, count)
        self.state[first : first + count] = bytes((LOST,)) * count
        self.counters.pages_lost += count

    def clear(self, first: int, count: int) -> None:
        """The pages are trimmed: they read as zeros."""
        if self.on_change is not None:
            self.on_change(first, count)
        self.state[first : first + count] = bytes(count)

    def trim_started(self, first: int, count: int) -> int:
        """A trim of these pages begins: they read as zeros from now on, and a write that
        races it leaves them so (`keep_trimmed`) until `trim_ended`. Returns the token to
        hand to `trim_ended`."""
        self.clear(first, count)
        self._next_token += 1
        self.trims[self._next_token] = (first, count)
        return self._next_token

    def trim_ended(self, token: int) -> None:
        del self.trims[token]

    def forget(self) -> None:
        """Every page is gone (the export was released). A new table, so that persisted
        tables keep what they held."""
        self.state = bytearray(self.pages)

    def trimmed_slabs(self, first: int, count: int) -> dict[int, list[int]]:
        """The pages of [first, first+count) that are not EMPTY, by slab: the keys a trim
        must FREE on the memservers."""
        st, end = self.state, first + count
        slabs: dict[int, list[int]] = {}
        p = first
        while p < end:
            q = st.find(EMPTY, p, end)
            q = end if q < 0 else q
            for slab, s, n in self.runs(p, q - p):
                slabs.setdefault(slab, []).extend(range(s, s + n))
            if q == end:
                break
            q2 = [x for x in (st.find(DATA, q, end), st.find(LOST, q, end)) if x >= 0]
            p = min(q2) if q2 else end
        return slabs

    # --- checking loaded bytes ---

    def write_started(self, first: int, count: int, data: memoryview) -> int:
        """A replicated write of `data` is about to leave: until `write_ended`, a read that
        races it may get its bytes from one replica, which `bad_pages` does not judge bad.
        Returns the token to hand to `write_ended` (another write may carry equal bytes)."""
        self._next_token += 1
        self.pending_writes[self._next_token] = (first, count, data)
        return self._next_token

    def write_ended(self, token: int) -> None:
        del self.pending_writes[token]

    def bad_pages(self, first: int, count: int, out: memoryview) -> list[int]:
        """The loaded pages that fail their checksum (pages not holding DATA any more,
        trimmed while the LOAD was in flight, are not judged; bytes of a replicated write
        still in flight, which a racing read may see on one replica, are not bad)."""
        crc, st = self.crc, self.state
        if count == 1:
            bad = [first] if st[first] == DATA and crc32(out) != crc[first] else []
        else:
            got = page_crcs(out, count)
            if got == crc[first : first + count]:  # the common case, compared in C
                return []
            bad = [
                first + k
                for k in range(count)
                if st[first + k] == DATA and got[k] != crc[first + k]
            ]
        if bad and self.pending_writes:
            bad = [
                p
                for p in bad
                if not self._in_flight_bytes(p, out[(p - first) << 12 : (p - first + 1) << 12])
            ]
        return bad

    def _in_flight_bytes(self, page: int, got: memoryview) -> bool:
        """`got` is page `page` as a replicated write still in flight writes it."""
        return any(
            f <= page < f + n and got == d[(page - f) << 12 : (page - f + 1) << 12]
            for f, n, d in self.pending_writes.values()
        )

    def pages_match(self, first: int, count: int, buf: memoryview) -> bool:
        """True when every page holds data and `buf` passes the checks of any load."""
        if self.state.count(DATA, first, first + count) != count:
            return False
        return not self.bad_pages(first, count, buf)


def slab_table_type() -> type[SlabTable]:
    """The compiled `SlabTable` (duvm.store._slabtable) when the compiled path runs here, else
    this one, the reference."""
    compiled = accel.load("duvm.store._slabtable")
    return compiled.SlabTable if compiled is not None else SlabTable
