"""Sequential readahead for `RemoteStore`: swap-in reads served from RAM the daemon fetched early.

Why: the kernel swaps pages back in with small reads (32 KiB, its swap readahead cluster) one at
a time (queue depth 1), mostly at consecutive offsets (measured on the demo workload: 77% of the
reads start where the previous one ended, 98.5% arrive with nothing else in flight). Each such
read costs a round trip to a memserver. Like nbdkit's readahead filter, once a reader is seen
going sequentially, the next `WINDOW_PAGES` pages are LOADed in one request ahead of it, and the
reads that fall inside that window are answered from it without a network trip.

Theory of operation:

- Only small reads (at most a quarter of a window, 64 KiB) start fetching ahead: a reader
  asking for large blocks with many in flight (nbdcopy) already covers what comes next.
- At most two windows: the one being read and the next. A read that ends past the middle of
  the newest window fetches the one after it, so a steady sequential reader always finds its
  pages ready. A window never crosses a slab (one LOAD from one memserver) and only covers pages
  that hold data (never-written pages are zeros without a trip anyway).
- A read that falls in a window still in flight waits for it (no second LOAD). A read that
  ends in the window after the one it starts in (the reader shifted by a page the kernel
  skipped: 7% of the demo workload's reads) is copied from both when both are ready.
- The next window is fetched after the reply to the read that called for it has been written
  (`call_soon`), not before: sending the LOAD wakes the memserver, which on a shared core ran
  before the reply went out (traced: 53-60 µs for that read against 13-15 µs for the others).
- A hit is answered with a view of the window (`done(tag, memoryview)`), sent to the NBD
  client without a copy: a window's bytes never change once it is ready (a change to its pages
  drops the whole window, whose buffer is never reused).
- Correctness: a window is exactly the bytes of the last acknowledged writes, or it is dropped.
  Arrived pages are checked against the store's per-page CRC-32C and state, as any load is; a
  mismatch or failure drops the window quietly (the read path then loads the page itself and
  judges the replica). Every change to a page (write acknowledged, trim, page lost) drops the
  windows that overlap it before any later read can look (`invalidate`, the table's
  `on_change` from the moment a window is opened; None while no window is held, so a stream
  of writes calls nothing per page). A LOAD that was sent
  before a STORE to the same page is answered first (one connection, in order), so it carries
  the old bytes and the STORE's acknowledgement then drops it; one sent after the STORE carries
  bytes whose checksum the store has not accepted yet, and is dropped on arrival. Reads that
  waited for a dropped window continue through the store's `read`, the general path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from duvm.store.counters import Counters
from duvm.store.slab_table import SlabTable
from duvm.store.storage import DATA, EMPTY, LOST, Done

log = logging.getLogger(__name__)

WINDOW_PAGES = 64  # 256 KiB per LOAD: 8 of the kernel's 32 KiB swap-in reads


class _Window:
    __slots__ = ("buf", "count", "first", "ready", "waiters")

    def __init__(self, first: int, count: int) -> None:
        self.first = first
        self.count = count
        self.buf = bytearray(count << 12)
        self.ready = False
        # reads waiting for this window: (first, count, out, done, tag)
        self.waiters: list[tuple[int, int, memoryview, Done, object]] = []


@dataclass(slots=True)
class ReadaheadCounters(Counters):
    ra_loads: int = 0
    ra_hits: int = 0
    ra_dropped: int = 0


class Readahead:
    """The readahead windows of one store (see the module docstring)."""

    def __init__(
        self,
        table: SlabTable,
        read: Callable[[int, memoryview], Coroutine[Any, Any, None]],
        window_pages: int = WINDOW_PAGES,
    ) -> None:
        self.table = table
        self._read = read  # the store's general read path, for reads a dropped window held
        self.window_pages = window_pages
        self.windows: list[_Window] = []
        self.next_page = -1  # where a sequential reader's next read starts
        self._scheduled: int | None = None  # first page of a fetch due after this reply
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters = ReadaheadCounters()
        # False in a daemon with several workers: another process's write to a page could not
        # drop a window held here (`invalidate` sees only this process's changes)
        self.enabled = True

    def hit(self, first: int, count: int, out: memoryview, done: Done, tag: object) -> bool:
        """Serve a read that lies inside a window (now, or when the window arrives) and keep
        fetching ahead of it; False when no window holds it (the caller loads it, then calls
        `missed`)."""
        for w in self.windows:
            if w.first <= first and first + count <= w.first + w.count:
                if not w.ready:
                    w.waiters.append((first, count, out, done, tag))
                self._advance(first, first + count)
                if w.ready:  # answered last: the caller may reply at once
                    self._serve(w, first, count, done, tag)
                return True
        return self._straddle(first, count, out, done, tag)

    def _straddle(self, first: int, count: int, out: memoryview, done: Done, tag: object) -> bool:
        """A read that ends in the window after the one it starts in (the reader shifted by a
        page the kernel skipped): copied from both when both are ready, else False (a miss)."""
        end = first + count
        a = next((w for w in self.windows if w.first <= first < w.first + w.count), None)
        if a is None or not a.ready:
            return False
        mid = a.first + a.count
        b = next((w for w in self.windows if w.first == mid and end <= w.first + w.count), None)
        if b is None or not b.ready:
            return False
        self._advance(first, end)
        n = (mid - first) << 12
        out[:n] = memoryview(a.buf)[(first - a.first) << 12 :]
        out[n:] = memoryview(b.buf)[: (end - mid) << 12]
        self.counters.ra_hits += 1
        done(tag, None)  # answered last, as in hit()
        return True

    def _advance(self, first: int, end: int) -> None:
        """A read of [first, end) was served from the windows: a sequential one keeps fetching
        ahead (a random read that happens to hit fetches nothing more)."""
        sequential = first == self.next_page
        self.next_page = end
        if sequential:
            self._ahead(end, later=True)

    def missed(self, first: int, count: int) -> None:
        """A read the caller sent to a memserver itself: if it continues the previous one,
        the reader is sequential, so fetch ahead (after its own LOAD, which goes first)."""
        if count > self.window_pages // 4 or not self.enabled:
            return  # a large reader already asks for enough at once: fetching ahead of it
            # only races its own requests in flight (measured: 256 KiB reads lost 25%)
        sequential = first == self.next_page
        self.next_page = first + count
        if sequential:
            self._ahead(first + count)

    def _ahead(self, end: int, later: bool = False) -> None:
        """The reader has reached page `end`: fetch the next window when it is needed (`later`:
        once the current replies have been written). Windows far from the reader (it jumped
        elsewhere) are forgotten."""
        if self._scheduled is not None:
            return  # a fetch is already due
        wp = self.window_pages
        ws = [w for w in self.windows if end - wp < w.first + w.count and w.first <= end + wp]
        if ws:
            last = max(ws, key=lambda w: w.first)
            if end < last.first + last.count // 2:
                self.windows = ws
                return  # not yet past the middle of the newest window
            start = max(end, last.first + last.count)
            if len(ws) >= 2:
                ws.remove(min(ws, key=lambda w: w.first))
        else:
            start = end
        self.windows = ws
        if not later:
            self._fetch(start)
            return
        if self._loop is None:  # cached: get_running_loop() is a getpid() on Python 3.11
            self._loop = asyncio.get_running_loop()
        self._scheduled = start
        self._loop.call_soon(self._fetch_due, start)

    def _fetch_due(self, first: int) -> None:
        if self._scheduled != first:
            return  # cleared meanwhile
        self._scheduled = None
        try:  # the read that called for it is answered: only the fetch is lost
            if not any(w.first == first for w in self.windows):
                self._fetch(first)
        except Exception:
            log.exception("fetching ahead failed; reading on without it")

    def _fetch(self, first: int) -> None:
        t = self.table
        if first >= t.pages:
            return
        sp = t.slab_pages
        slab = first // sp
        end = min(first + self.window_pages, (slab + 1) * sp, t.pages)
        st = t.state
        if st[first] != DATA:
            return
        count = end - first  # up to the first page that holds no data
        for other in (EMPTY, LOST):
            q = st.find(other, first, end)
            if q >= 0:
                count = min(count, q - first)
        c = t.slab_clients[slab][0]
        if count > c.max_batch:
            count = c.max_batch
        w = _Window(first, count)
        keys = tuple(range(first, first + count))
        if c.load_cb(keys, memoryview(w.buf), lambda exc: self._arrived(w, exc)):
            t.on_change = self.invalidate  # before the window exists: no change goes unseen
            self.windows.append(w)
            self.counters.ra_loads += 1

    def _arrived(self, w: _Window, exc: BaseException | None) -> None:
        try:
            good = (
                exc is None
                and w in self.windows
                and self.table.pages_match(w.first, w.count, memoryview(w.buf))
            )
        except Exception:  # the waiting reads must still be answered: by the general path
            good = False
        if good:
            w.ready = True
        elif w in self.windows:  # (a window invalidate() dropped is counted there)
            self.windows.remove(w)
            self.counters.ra_dropped += 1
            self._unwatch()
        waiters, w.waiters = w.waiters, []
        for first, count, out, done, tag in waiters:
            if good:
                self._serve(w, first, count, done, tag)
            else:  # the general path loads it, with failover and judging the replicas
                done(tag, self._read(first << 12, out))

    def _serve(self, w: _Window, first: int, count: int, done: Done, tag: object) -> None:
        """Answer a read from a ready window with a view of it (no copy)."""
        self.counters.ra_hits += 1
        a = (first - w.first) << 12
        done(tag, memoryview(w.buf)[a : a + (count << 12)])

    def invalidate(self, first: int, count: int) -> None:
        """Pages [first, first+count) change: drop every window that holds any of them."""
        if not self.windows:
            return
        end = first + count
        keep = [w for w in self.windows if w.first + w.count <= first or end <= w.first]
        if len(keep) != len(self.windows):
            self.counters.ra_dropped += len(self.windows) - len(keep)
            self.windows = keep
            self._unwatch()

    def _unwatch(self) -> None:
        """No window left: the table's changes need not be told (`on_change` None) until the
        next window opens (`_fetch`)."""
        if not self.windows and self.table.on_change == self.invalidate:
            self.table.on_change = None

    def clear(self) -> None:
        self.windows = []
        self.next_page = -1
        self._scheduled = None
        self._unwatch()
