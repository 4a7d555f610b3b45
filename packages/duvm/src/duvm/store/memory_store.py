"""A `BlockStore` in this process's RAM: the baseline for tests and benchmarks.

Theory of operation: one private anonymous mapping of the export's size. The kernel backs a
page only once it is written, so an untouched export costs nothing; TRIM and WRITE_ZEROES give
whole pages back with madvise(MADV_DONTNEED), after which they read as zeros again (that is
what a private anonymous mapping promises), and zero any partial pages at the edges. Every
operation completes without suspending: reads and writes take the callback fast path and are
answered before `start_read`/`start_write` return, with no coroutine or Task.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

from duvm.store.counters import Counters
from duvm.store.storage import PAGE_SIZE, BlockStore, Capabilities, Done


@dataclass(slots=True)
class MemoryCounters(Counters):
    read: int = 0
    write: int = 0
    trim: int = 0
    zero: int = 0
    flush: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_freed: int = 0


class MemoryStore(BlockStore):
    """`size` bytes of local RAM; `own_counters` count calls and bytes per operation."""

    capabilities = Capabilities()
    fast_path = True  # answered at once (BlockStore.start_read)

    def describe(self) -> str:
        return "local RAM"

    def __init__(self, size: int) -> None:
        if size <= 0 or size % PAGE_SIZE:
            raise ValueError(f"size must be a positive multiple of {PAGE_SIZE}, not {size}")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self.own_counters = MemoryCounters()

    def counters(self) -> dict[str, int]:
        return self.own_counters.snapshot()

    def _read(self, offset: int, out: memoryview) -> None:
        n = len(out)
        assert offset >= 0 and offset + n <= self.size
        out[:] = self._view[offset : offset + n]
        self.own_counters.read += 1
        self.own_counters.bytes_read += n

    def _write(self, offset: int, data: memoryview) -> None:
        n = len(data)
        assert offset >= 0 and offset + n <= self.size
        self._view[offset : offset + n] = data
        self.own_counters.write += 1
        self.own_counters.bytes_written += n

    def start_read(self, offset: int, out: memoryview, done: Done, tag: object) -> bool:
        self._read(offset, out)
        done(tag, None)
        return True

    def start_write(self, offset: int, data: memoryview, done: Done, tag: object) -> bool:
        self._write(offset, data)
        done(tag, None)
        return True

    async def read(self, offset: int, out: memoryview) -> None:
        self._read(offset, out)

    async def write(self, offset: int, data: memoryview) -> None:
        self._write(offset, data)

    def _discard(self, offset: int, length: int) -> None:
        assert offset >= 0 and offset + length <= self.size and length >= 0
        end = offset + length
        first = -(-offset // PAGE_SIZE) * PAGE_SIZE  # first whole page
        last = end // PAGE_SIZE * PAGE_SIZE
        if first < last:
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
            self.own_counters.bytes_freed += last - first
            if offset < first:
                self._view[offset:first] = bytes(first - offset)
            if last < end:
                self._view[last:end] = bytes(end - last)
        elif length:
            self._view[offset:end] = bytes(length)

    async def trim(self, offset: int, length: int) -> None:
        self._discard(offset, length)
        self.own_counters.trim += 1

    async def write_zeroes(self, offset: int, length: int) -> None:
        self._discard(offset, length)
        self.own_counters.zero += 1

    async def flush(self) -> None:
        self.own_counters.flush += 1

    async def close(self) -> None:
        self._view.release()
        self._map.close()
